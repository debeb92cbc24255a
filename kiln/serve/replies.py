"""The scheduler's events as OpenAI replies: a whole response body once every choice has finished,
or server-sent events as the tokens arrive (choice i of a request is its i-th handle)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from kiln.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    TokenText,
    chat_logprob_entry,
    completion_logprobs,
    internal_error,
    usage,
)
from kiln.serve.requests import PromptScores, SchedulerError, TokenEvent

log = logging.getLogger(__name__)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    """The chunks as an event stream ending in [DONE]; a failure mid-stream, after the 200 is sent,
    becomes an error event, so the response still ends properly and its connection stays usable."""

    async def body():
        try:
            async for chunk in chunks:
                yield chunk
        except SchedulerError as err:
            yield sse(APIError(500, str(err), type="server_error").body())
        except Exception as err:
            log.exception("stream failed")
            yield sse(internal_error(err).body())
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def collect(handle) -> dict:
    """One choice's generation: its token ids, text, logprobs and top alternatives, finish reason,
    and the prompt's PromptScores if it asked for them."""
    out = {"ids": [], "text": "", "logprobs": [], "tops": [], "finish": "length", "scores": None}
    async for event in handle:
        if isinstance(event, PromptScores):
            out["scores"] = event
            continue
        out["ids"].append(event.id)
        out["text"] += event.text
        out["logprobs"].append(event.logprob)
        out["tops"].append(event.top)
        if event.finish_reason is not None:
            out["finish"] = event.finish_reason
    return out


async def collect_all(handles) -> list[dict]:
    try:
        return await asyncio.gather(*(collect(h) for h in handles))
    except SchedulerError as err:
        raise APIError(500, str(err), type="server_error") from None
    finally:
        for handle in handles:
            handle.cancel()  # a no-op for finished requests; frees the rows of an abandoned one


async def merged(handles) -> AsyncIterator[tuple[int, object]]:
    """(choice index, event) of all handles as they arrive."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(i, handle):
        try:
            async for event in handle:
                await events.put((i, event))
            await events.put((i, None))
        except SchedulerError as err:
            await events.put((i, err))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, event = await events.get()
            if event is None:
                remaining -= 1
            elif isinstance(event, SchedulerError):
                raise event
            else:
                yield i, event
    finally:
        for handle in handles:
            handle.cancel()
        for task in tasks:
            task.cancel()


@dataclass
class CompletionReply:
    """The reply to one /v1/completions request; choice i continues prompt i // n."""

    body: CompletionRequest
    prompts: list[tuple[list[int], str]]  # (ids, text) per prompt
    model_name: str
    token_text: TokenText
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def include_usage(self) -> bool:
        return self.body.stream_options is not None and self.body.stream_options.include_usage

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.prompts)

    def head(self, choices: list) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }

    def echoed(self, i: int) -> tuple[str, list[int], list, list]:
        """(text, ids, logprobs, tops) that echo choice i's prompt, before its generated tokens."""
        ids, text = self.prompts[i // self.body.n]
        return text, ids, [], []

    def whole(self, results: list[dict]) -> dict:
        choices = []
        for i, out in enumerate(results):
            prefix, ids, lps, tops = self.echoed(i) if self.body.echo else ("", [], [], [])
            logprobs = None
            if self.body.logprobs is not None:
                if out["scores"] is not None:
                    lps, tops = out["scores"].logprobs, out["scores"].top
                logprobs = completion_logprobs(
                    self.token_text, ids + out["ids"], lps + out["logprobs"], tops + out["tops"]
                )
            choices.append(
                {"index": i, "text": prefix + out["text"], "logprobs": logprobs, "finish_reason": out["finish"]}
            )
        completion_tokens = sum(len(out["ids"]) for out in results)
        return {**self.head(choices), "usage": usage(self.prompt_tokens, completion_tokens)}

    def chunk(self, i: int, text: str, logprobs, finish) -> str:
        extra = {"usage": None} if self.include_usage else {}
        return sse({**self.head([{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]), **extra})

    async def chunks(self, handles) -> AsyncIterator[str]:
        offsets = [0] * len(handles)  # text_offset of each choice's next token
        counts = [0] * len(handles)
        if self.body.echo and self.body.logprobs is None:
            for i in range(len(handles)):
                text = self.echoed(i)[0]
                offsets[i] = len(text)
                yield self.chunk(i, text, None, None)
        async for i, event in merged(handles):
            if isinstance(event, PromptScores):
                text, ids, _, _ = self.echoed(i)
                logprobs = completion_logprobs(self.token_text, ids, event.logprobs, event.top)
                offsets[i] = len(text)
                yield self.chunk(i, text, logprobs, None)
                continue
            counts[i] += 1
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = completion_logprobs(self.token_text, [event.id], [event.logprob], [event.top], offsets[i])
            offsets[i] += len(event.text)
            if event.text or logprobs is not None or event.finish_reason is not None:
                yield self.chunk(i, event.text, logprobs, event.finish_reason)
        if self.include_usage:
            yield sse({**self.head([]), "usage": usage(self.prompt_tokens, sum(counts))})


@dataclass
class ChatReply:
    """The reply to one /v1/chat/completions request; every choice answers the same prompt."""

    body: ChatRequest
    prompt_tokens: int
    stop_ids: set[int]
    logprobs: int | None  # top alternatives per token; None: no logprobs
    model_name: str
    token_text: TokenText
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def include_usage(self) -> bool:
        return self.body.stream_options is not None and self.body.stream_options.include_usage

    def head(self, choices: list, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name, "choices": choices}

    def entries(self, events: list[tuple[int, float, list | None]]) -> list[dict]:
        # The token that ended the turn (<|end|>) is not part of the message, so it has no entry.
        return [chat_logprob_entry(self.token_text, t, lp, top) for t, lp, top in events if t not in self.stop_ids]

    def whole(self, results: list[dict]) -> dict:
        choices = []
        for i, out in enumerate(results):
            logprobs = None
            if self.logprobs is not None:
                logprobs = {"content": self.entries(list(zip(out["ids"], out["logprobs"], out["tops"])))}
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": out["text"]},
                    "logprobs": logprobs,
                    "finish_reason": out["finish"],
                }
            )
        completion_tokens = sum(len(out["ids"]) for out in results)
        return {**self.head(choices, "chat.completion"), "usage": usage(self.prompt_tokens, completion_tokens)}

    def chunk(self, i: int, delta: dict, logprobs, finish) -> str:
        extra = {"usage": None} if self.include_usage else {}
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**self.head([choice], "chat.completion.chunk"), **extra})

    async def chunks(self, handles) -> AsyncIterator[str]:
        counts = [0] * len(handles)
        for i in range(len(handles)):
            yield self.chunk(i, {"role": "assistant", "content": ""}, None, None)
        async for i, event in merged(handles):
            assert isinstance(event, TokenEvent)
            counts[i] += 1
            logprobs = None
            if self.logprobs is not None:
                logprobs = {"content": self.entries([(event.id, event.logprob, event.top)])}
            delta = {"content": event.text} if event.text else {}
            if delta or event.finish_reason is not None or (logprobs and logprobs["content"]):
                yield self.chunk(i, delta, logprobs, event.finish_reason)
        if self.include_usage:
            yield sse({**self.head([], "chat.completion.chunk"), "usage": usage(self.prompt_tokens, sum(counts))})
