"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions (streamed over
server-sent events when asked), /health, lm-eval's remote-tokenizer endpoints (/tokenizer_info,
/tokenize, /detokenize), the chat page at /, and FastAPI's /openapi.json and /docs.

Requests become GenerationRequests for the continuous-batching Scheduler (one per choice); its
thread runs the model while the event loop keeps answering. Every failure a client can cause is a
4xx with an OpenAI error body, and never stops the server. See docs/serve.md.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from kiln.data.chat import CHAT_TEMPLATE, PAD, ChatTokens, render_prompt
from kiln.errors import ConfigError, DataError
from kiln.infer.engine import SamplingParams
from kiln.serve.chat_page import chat_page
from kiln.serve.protocol import (
    ERROR_STATUSES,
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
    TokenText,
    chat_logprob_entry,
    completion_logprobs,
    messages_to_dicts,
    stop_strings,
    usage,
)
from kiln.serve.scheduler import Busy, GenerationRequest, PromptScores, Scheduler, SchedulerError, TokenEvent


class BodyLimit:
    """Refuse request bodies over max_bytes with a 413, by Content-Length and while reading (a
    chunked body has no length), before any of it is parsed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(
            413, f"request body is larger than the server's limit of {self.max_bytes} bytes", code="request_too_large"
        )
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await JSONResponse(too_large.body(), 413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                # FastAPI re-raises an HTTPException from reading the body; the handler below
                # turns it into the error body.
                raise HTTPException(413, too_large.message)
            return message

        return await self.app(scope, limited, send)


GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def create_app(
    model,
    tokenizer,
    *,
    model_name: str = "kiln",
    api_keys: Sequence[str] = (),
    max_body_bytes: int = 1 << 20,
    max_tokens_limit: int | None = None,
    max_batch: int = 32,
    max_waiting: int = 256,
    max_prefill_tokens: int = 8192,
) -> FastAPI:
    """The app for one model. api_keys: when given, /v1/* and the tokenizer endpoints need
    `Authorization: Bearer <key>`. max_tokens_limit (default: the model's context) caps a request's
    max_tokens; max_batch rows decode together and max_waiting more requests queue (then 429)."""
    cfg = model.cfg
    limit = cfg.max_seq_len if max_tokens_limit is None else max_tokens_limit
    keys = [k.encode() for k in api_keys if k]
    if any(v < 1 for v in (limit, max_body_bytes)):
        raise ConfigError("max_tokens_limit" if limit < 1 else "max_body_bytes", "must be >= 1")
    try:
        chat_tokens = ChatTokens(tokenizer)
    except DataError:  # a tokenizer without Kiln's role tokens (e.g. imported) still serves completions
        chat_tokens = None
    token_text = TokenText(tokenizer)
    page = chat_page(model_name, auth=bool(keys))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.scheduler = Scheduler(model, tokenizer, max_batch, max_waiting, max_prefill_tokens)
        try:
            yield
        finally:
            app.state.scheduler.close()

    # Every route declares the error answers, so clients and schema-driven tests know their shape.
    errors = {status: {"model": ErrorResponse, "description": text} for status, text in ERROR_STATUSES.items()}
    app = FastAPI(
        title="Kiln", summary="OpenAI-compatible server for a Kiln model", lifespan=lifespan, responses=errors
    )
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            message = f"request body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')})"
            return JSONResponse(APIError(400, message).body(), 400)
        param = ".".join(loc) or None
        message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(APIError(400, message, param=param).body(), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        body = APIError(err.status_code, str(err.detail), code="request_too_large" if err.status_code == 413 else None)
        return JSONResponse(body.body(), err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def crashed(request: Request, err: Exception):
        message = f"internal error: {type(err).__name__}: {err}"
        return JSONResponse(APIError(500, message, type="server_error").body(), 500)

    async def check_key(request: Request) -> None:
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        # Every key is compared, each in constant time, so timing tells nothing about which matched.
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(given, key)
        if scheme.lower() != "bearer" or not matched:
            raise APIError(
                401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    authed = [Depends(check_key)]

    def check_model(name: str | None) -> None:
        if name not in (None, model_name):
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{model_name}'",
                param="model",
                code="model_not_found",
            )

    def check_common(body) -> None:
        check_model(body.model)
        for name, value in body.unsupported():
            raise APIError(400, f"{name}={value!r} is not supported by this server", param=name)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if not 1 <= body.n <= max_batch:
            raise APIError(400, f"n must be in 1..{max_batch}, got {body.n}", param="n")

    def check_max_tokens(value: int, param: str) -> None:
        if value > limit:
            raise APIError(400, f"{param}={value} is over this server's limit of {limit}", param=param)

    def sampling(body) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        if 0 <= temperature < GREEDY_BELOW:
            # As vLLM does: this close to 0 sampling is greedy anyway, and dividing float32 logits by
            # such a temperature overflows to inf and NaN, failing every request in the batch.
            temperature = 0.0
        top_p = 1.0 if body.top_p is None else body.top_p
        if 0 < top_p < FLOAT32_TINY:
            # A smaller top_p rounds to 0 against float32 probabilities and drops every token; any
            # top_p this small keeps just the most likely token, as the floor does.
            top_p = FLOAT32_TINY
        return SamplingParams(temperature, body.top_k, top_p, body.min_p, body.repetition_penalty)

    def submit(requests: list[GenerationRequest], rename: dict[str, str]) -> list:
        scheduler: Scheduler = app.state.scheduler
        if not scheduler.alive:
            raise APIError(503, "the model is not running", type="server_error")
        if len(requests) > max_batch + max_waiting:
            raise APIError(
                400, f"{len(requests)} choices in one request exceed this server's {max_batch + max_waiting}", param="n"
            )
        try:
            return scheduler.submit(requests, loop=asyncio.get_running_loop())
        except ConfigError as err:
            raise APIError(
                400, f"{rename.get(err.key, err.key)}: {err.message}", param=rename.get(err.key, err.key)
            ) from None
        except Busy as err:
            raise APIError(429, f"server busy: {err}", type="rate_limit_error", code="rate_limit_exceeded") from None

    async def collect(handle) -> dict:
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

    def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
        async def body():
            try:
                async for chunk in chunks:
                    yield chunk
            except SchedulerError as err:
                yield _sse(APIError(500, str(err), type="server_error").body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        return HTMLResponse(page)

    down = {"type": "object", "properties": {"status": {"type": "string", "enum": ["down"]}}, "required": ["status"]}

    @app.get(
        "/health",
        responses={503: {"description": "the model is not running", "content": {"application/json": {"schema": down}}}},
    )
    async def health():
        scheduler = getattr(app.state, "scheduler", None)
        if scheduler is None or not scheduler.alive:
            return JSONResponse({"status": "down"}, 503)
        running, waiting = scheduler.load
        return {"status": "ok", "running": running, "waiting": waiting}

    @app.get("/v1/models", dependencies=authed)
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kiln",
                    "root": model_name,
                    "max_model_len": cfg.max_seq_len,
                }
            ],
        }

    @app.get("/tokenizer_info", dependencies=authed)
    async def tokenizer_info():
        return {
            "eos_token": tokenizer.decode([tokenizer.eot_id]),
            "bos_token": None,
            "pad_token": PAD,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": cfg.max_seq_len,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }

    @app.post("/tokenize", dependencies=authed)
    async def tokenize(body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.prompt is not None:
            tokens = tokenizer.encode(body.prompt)
        else:
            try:
                tokens = render_prompt(tokenizer, messages_to_dicts(body.messages))
            except DataError as err:
                raise APIError(400, str(err), param="messages") from None
        return {"count": len(tokens), "max_model_len": cfg.max_seq_len, "tokens": tokens}

    @app.post("/detokenize", dependencies=authed)
    async def detokenize(body: DetokenizeRequest):
        if any(not 0 <= t < tokenizer.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in 0..{tokenizer.vocab_size - 1}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    def encode_prompts(prompt) -> list[tuple[list[int], str]]:
        """(ids, text) per prompt: text prompts are encoded, token-id prompts decoded (for echo)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append((tokenizer.encode(p), p))
            else:
                if any(not 0 <= t < cfg.vocab_size for t in p):
                    raise APIError(400, f"prompt token ids must be in 0..{cfg.vocab_size - 1}", param="prompt")
                out.append((list(p), tokenizer.decode(p)))
        return out

    @app.post("/v1/completions", dependencies=authed)
    async def completions(body: CompletionRequest):
        check_common(body)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        if max_tokens < 0 or (max_tokens == 0 and not body.echo):
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo, to score the prompt)", param="max_tokens")
        check_max_tokens(max_tokens, "max_tokens")
        prompts = encode_prompts(body.prompt)
        stop_ids = ([] if body.ignore_eos else [tokenizer.eot_id]) + list(body.stop_token_ids or [])
        params, stops = sampling(body), stop_strings(body.stop)
        requests = [
            GenerationRequest(
                ids,
                max_tokens,
                params,
                stop_ids,
                stops,
                None if body.seed is None else body.seed + j,
                body.logprobs,
                prompt_logprobs=body.echo and body.logprobs is not None,
                skip_special_tokens=body.skip_special_tokens,
            )
            for ids, _ in prompts
            for j in range(body.n)
        ]
        handles = submit(requests, {})
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(ids) for ids, _ in prompts)

        def echoed(i: int) -> tuple[str, list[int], list, list]:
            ids, text = prompts[i // body.n]
            return text, ids, [], []

        def head(choices: list) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices}

        if not body.stream:
            results = await collect_all(handles)
            choices = []
            for i, out in enumerate(results):
                prefix, ids, lps, tops = echoed(i) if body.echo else ("", [], [], [])
                logprobs = None
                if body.logprobs is not None:
                    if out["scores"] is not None:
                        lps, tops = out["scores"].logprobs, out["scores"].top
                    logprobs = completion_logprobs(
                        token_text, ids + out["ids"], lps + out["logprobs"], tops + out["tops"]
                    )
                choices.append(
                    {"index": i, "text": prefix + out["text"], "logprobs": logprobs, "finish_reason": out["finish"]}
                )
            completion_tokens = sum(len(out["ids"]) for out in results)
            return {**head(choices), "usage": usage(prompt_tokens, completion_tokens)}

        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(i: int, text: str, logprobs, finish) -> str:
            extra = {"usage": None} if include_usage else {}
            return _sse({**head([{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]), **extra})

        async def chunks():
            offsets = [0] * len(handles)
            counts = [0] * len(handles)
            if body.echo and body.logprobs is None:
                for i in range(len(handles)):
                    text = echoed(i)[0]
                    offsets[i] = len(text)
                    yield chunk(i, text, None, None)
            async for i, event in merged(handles):
                if isinstance(event, PromptScores):
                    text, ids, _, _ = echoed(i)
                    logprobs = completion_logprobs(token_text, ids, event.logprobs, event.top)
                    offsets[i] = len(text)
                    yield chunk(i, text, logprobs, None)
                    continue
                counts[i] += 1
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(token_text, [event.id], [event.logprob], [event.top], offsets[i])
                offsets[i] += len(event.text)
                if event.text or logprobs is not None or event.finish_reason is not None:
                    yield chunk(i, event.text, logprobs, event.finish_reason)
            if include_usage:
                yield _sse({**head([]), "usage": usage(prompt_tokens, sum(counts))})

        return sse_response(chunks())

    @app.post("/v1/chat/completions", dependencies=authed)
    async def chat_completions(body: ChatRequest):
        check_common(body)
        if chat_tokens is None:
            raise APIError(
                400,
                "this model's tokenizer has no chat tokens (<|user|>, <|assistant|>, <|end|>); use /v1/completions",
                param="messages",
            )
        try:
            prompt = render_prompt(tokenizer, messages_to_dicts(body.messages))
        except DataError as err:
            raise APIError(400, str(err), param="messages") from None
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(limit, cfg.max_seq_len - len(prompt)))
        if max_tokens < 1:
            raise APIError(400, f"{param} must be >= 1", param=param)
        check_max_tokens(max_tokens, param)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        stop_ids = ([] if body.ignore_eos else list(chat_tokens.stop)) + list(body.stop_token_ids or [])
        params, stops = sampling(body), stop_strings(body.stop)
        requests = [
            GenerationRequest(
                prompt,
                max_tokens,
                params,
                stop_ids,
                stops,
                None if body.seed is None else body.seed + j,
                k,
                skip_special_tokens=body.skip_special_tokens,
            )
            for j in range(body.n)
        ]
        handles = submit(requests, {"prompt": "messages", "logprobs": "top_logprobs"})
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stop_set = set(stop_ids)

        def entries(events: list[tuple[int, float, list | None]]) -> list[dict]:
            # The token that ended the turn (<|end|>) is not part of the message, so it has no entry.
            return [chat_logprob_entry(token_text, t, lp, top) for t, lp, top in events if t not in stop_set]

        def head(choices: list, kind: str) -> dict:
            return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices}

        if not body.stream:
            results = await collect_all(handles)
            choices = []
            for i, out in enumerate(results):
                logprobs = None
                if k is not None:
                    logprobs = {"content": entries(list(zip(out["ids"], out["logprobs"], out["tops"])))}
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": out["text"]},
                        "logprobs": logprobs,
                        "finish_reason": out["finish"],
                    }
                )
            completion_tokens = sum(len(out["ids"]) for out in results)
            return {**head(choices, "chat.completion"), "usage": usage(len(prompt), completion_tokens)}

        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(i: int, delta: dict, logprobs, finish) -> str:
            extra = {"usage": None} if include_usage else {}
            return _sse(
                {
                    **head(
                        [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                        "chat.completion.chunk",
                    ),
                    **extra,
                }
            )

        async def chunks():
            counts = [0] * len(handles)
            for i in range(len(handles)):
                yield chunk(i, {"role": "assistant", "content": ""}, None, None)
            async for i, event in merged(handles):
                assert isinstance(event, TokenEvent)
                counts[i] += 1
                logprobs = None
                if k is not None:
                    logprobs = {"content": entries([(event.id, event.logprob, event.top)])}
                delta = {"content": event.text} if event.text else {}
                if delta or event.finish_reason is not None or (logprobs and logprobs["content"]):
                    yield chunk(i, delta, logprobs, event.finish_reason)
            if include_usage:
                yield _sse({**head([], "chat.completion.chunk"), "usage": usage(len(prompt), sum(counts))})

        return sse_response(chunks())

    return app
