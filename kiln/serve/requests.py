"""What a request to the scheduler is and what comes back: GenerationRequest in; through its
Handle, PromptScores (if asked), then TokenEvents until one carries a finish_reason, or a
SchedulerError. Busy when the queue is full (the server's 429)."""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass, field
from typing import Sequence

from kiln.infer.config import SamplingParams

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs: more top tokens per position are refused


@dataclass
class GenerationRequest:
    prompt: list[int]
    max_tokens: int  # 0: no generation, only the prompt's log-probabilities
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    seed: int | None = None  # None: drawn from torch's global generator
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely ones'
    prompt_logprobs: bool = False  # log-probabilities of the prompt tokens (echo)
    skip_special_tokens: bool = False  # leave special tokens out of the text (vLLM's default; Engine keeps them)


@dataclass
class PromptScores:
    """First event of a request with prompt_logprobs: per prompt token, its log-probability given
    the tokens before it and the top-k alternatives there (None for the first token)."""

    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


@dataclass
class TokenEvent:
    id: int
    text: str  # new text; "" while a character or a possible stop string is held back
    logprob: float  # log-softmax of the model's logits (temperature 1, no filters)
    top: list[tuple[int, float]] | None = None  # (id, logprob) of the most likely tokens, with logprobs=k
    finish_reason: str | None = None  # "stop" | "length" on the request's last token


class Busy(RuntimeError):
    """The waiting queue is full; the server answers 429."""


class SchedulerError(RuntimeError):
    """The request failed (its own row, or the decode forward of its whole batch), or the scheduler
    stopped; the other requests carry on."""


DONE = object()  # the last item of every handle's queue


class Handle:
    """One request's events: PromptScores (if asked), then TokenEvents until one carries a
    finish_reason. Iterating raises SchedulerError if the request failed."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self.cancelled = False
        self._loop = loop
        self._queue: asyncio.Queue | queue.Queue = asyncio.Queue() if loop is not None else queue.Queue()

    def cancel(self) -> None:
        """The client went away: the row leaves the batch at the next step."""
        self.cancelled = True

    def put(self, item) -> None:
        if self._loop is None:
            self._queue.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def __aiter__(self):
        while True:
            item = await self._queue.get()
            if item is DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
