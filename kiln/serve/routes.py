"""The server's endpoints, on one APIRouter that create_app includes, and the checks that turn an
OpenAI request into the Scheduler's GenerationRequests. What a route needs of its app (tokenizer,
limits, scheduler) is the app's ServeState, on app.state.serve, given by the ServeStateDep dependency.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.routing import APIRoute

from kiln.data.chat import chat_format, chat_stop_ids, chat_template_text, no_chat_format, render_prompt
from kiln.errors import ConfigError, DataError
from kiln.infer.config import SamplingParams
from kiln.serve.chat_page import chat_page
from kiln.serve.prefix_cache import PrefixCache
from kiln.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    TokenText,
    check_json_body,
    messages_to_dicts,
    stop_strings,
)
from kiln.serve.replies import ChatReply, CompletionReply, collect_all, sse_response
from kiln.serve.requests import Busy, GenerationRequest
from kiln.serve.scheduler import Scheduler

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny


@dataclass
class ServeState:
    """What the routes of one app share: create_app's arguments, what follows from them (the end
    of text and chat stop tokens, token texts, the chat page), and the scheduler, which the app's
    lifespan starts and closes."""

    model: Any
    tokenizer: Any
    model_name: str
    api_keys: list[bytes]
    max_tokens_limit: int
    max_batch: int
    max_waiting: int
    max_prefill_tokens: int
    prefix_cache: PrefixCache | None = None
    prefill_chunk_tokens: int = 0
    chat_trained: bool = True
    eos_id: int = field(init=False)
    chat_stop: tuple[int, ...] | None = field(init=False)
    token_text: TokenText = field(init=False)
    page: str = field(init=False)
    scheduler: Scheduler | None = field(init=False, default=None)

    def __post_init__(self):
        self.eos_id = self.tokenizer.eot_id  # completions stop there: a tokenizer without one is refused here
        # A tokenizer with no chat format (no template, not Kiln's role tokens) still serves completions.
        self.chat_stop = chat_stop_ids(self.tokenizer) if chat_format(self.tokenizer) else None
        self.token_text = TokenText(self.tokenizer)
        self.page = chat_page(
            self.model_name, auth=bool(self.api_keys), context=self.cfg.max_seq_len, chat_trained=self.chat_trained
        )

    @property
    def cfg(self):
        return self.model.cfg


def serve_state(request: Request) -> ServeState:
    return request.app.state.serve


ServeStateDep = Annotated[ServeState, Depends(serve_state)]


async def check_key(request: Request, state: ServeStateDep) -> None:
    if not state.api_keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip().encode()
    # Every key is compared, each in constant time, so timing tells nothing about which matched.
    matched = False
    for key in state.api_keys:
        matched |= hmac.compare_digest(given, key)
    if scheme.lower() != "bearer" or not matched:
        raise APIError(
            401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
        )


AUTHED = [Depends(check_key)]


def check_model(state: ServeState, name: str | None) -> None:
    if name not in (None, state.model_name):
        raise APIError(
            404,
            f"the model '{name}' does not exist; this server serves '{state.model_name}'",
            param="model",
            code="model_not_found",
        )


def check_common(state: ServeState, body: CompletionRequest | ChatRequest) -> None:
    check_model(state, body.model)
    for name, value in body.unsupported():
        raise APIError(400, f"{name}={value!r} is not supported by this server", param=name)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if not 1 <= body.n <= state.max_batch:
        raise APIError(400, f"n must be in 1..{state.max_batch}, got {body.n}", param="n")


def check_max_tokens(state: ServeState, value: int, param: str) -> None:
    if value > state.max_tokens_limit:
        raise APIError(400, f"{param}={value} is over this server's limit of {state.max_tokens_limit}", param=param)


def sampling(body: CompletionRequest | ChatRequest) -> SamplingParams:
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


def encode_prompts(state: ServeState, prompt) -> list[tuple[list[int], str]]:
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
            out.append((state.tokenizer.encode(p), p))
        else:
            if any(not 0 <= t < state.cfg.vocab_size for t in p):
                raise APIError(400, f"prompt token ids must be in 0..{state.cfg.vocab_size - 1}", param="prompt")
            out.append((list(p), state.tokenizer.decode(p)))
    return out


def encode_messages(state: ServeState, messages) -> list[int]:
    try:
        return render_prompt(state.tokenizer, messages_to_dicts(messages))
    except DataError as err:
        raise APIError(400, str(err), param="messages") from None


def submit(state: ServeState, requests: list[GenerationRequest], rename: dict[str, str]) -> list:
    """The requests' handles from the scheduler. rename: the request field to blame for an error
    the scheduler reports under its own name."""
    scheduler = state.scheduler
    if scheduler is None or not scheduler.alive:
        raise APIError(503, "the model is not running", type="server_error")
    if len(requests) > state.max_batch + state.max_waiting:
        raise APIError(
            400,
            f"{len(requests)} choices in one request exceed this server's {state.max_batch + state.max_waiting}",
            param="n",
        )
    try:
        return scheduler.submit(requests, loop=asyncio.get_running_loop())
    except ConfigError as err:
        param = rename.get(err.key, err.key)
        raise APIError(400, f"{param}: {err.message}", param=param) from None
    except Busy as err:
        raise APIError(429, f"server busy: {err}", type="rate_limit_error", code="rate_limit_exceeded") from None


class CheckedBodyRoute(APIRoute):
    """A route whose JSON body is checked for non-finite numbers and lone surrogates (check_json_body)
    before FastAPI parses it into the request model: one check for every field of every endpoint,
    including the fields pydantic would take as float('nan') or a str it cannot encode."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            body = await request.body()  # cached on the request: FastAPI reads it again, for free
            if body:
                check_json_body(body)
            return await handler(request)

        return checked


router = APIRouter(route_class=CheckedBodyRoute)


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index(state: ServeStateDep):
    return HTMLResponse(state.page)


DOWN_SCHEMA = {"type": "object", "properties": {"status": {"type": "string", "enum": ["down"]}}, "required": ["status"]}


@router.get(
    "/health",
    responses={
        503: {"description": "the model is not running", "content": {"application/json": {"schema": DOWN_SCHEMA}}}
    },
)
async def health(state: ServeStateDep):
    scheduler = state.scheduler
    if scheduler is None or not scheduler.alive:
        return JSONResponse({"status": "down"}, 503)
    running, waiting = scheduler.load
    health = {"status": "ok", "running": running, "waiting": waiting}
    if scheduler.prefix_cache is not None:  # its hits, misses, tokens_reused, entries and bytes
        health["prefix_cache"] = dict(scheduler.prefix_cache.stats)
    return health


@router.get("/v1/models", dependencies=AUTHED)
async def models(state: ServeStateDep):
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "kiln",
                "root": state.model_name,
                "max_model_len": state.cfg.max_seq_len,
            }
        ],
    }


@router.get("/tokenizer_info", dependencies=AUTHED)
async def tokenizer_info(state: ServeStateDep):
    return {
        "eos_token": state.tokenizer.special["eos_token"],
        "bos_token": state.tokenizer.special["bos_token"],
        "pad_token": state.tokenizer.special["pad_token"],
        "chat_template": chat_template_text(state.tokenizer),
        "model_max_length": state.cfg.max_seq_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


@router.post("/tokenize", dependencies=AUTHED)
async def tokenize(body: TokenizeRequest, state: ServeStateDep):
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        tokens = state.tokenizer.encode(body.prompt)
    else:
        tokens = encode_messages(state, body.messages)
    return {"count": len(tokens), "max_model_len": state.cfg.max_seq_len, "tokens": tokens}


@router.post("/detokenize", dependencies=AUTHED)
async def detokenize(body: DetokenizeRequest, state: ServeStateDep):
    vocab_size = state.tokenizer.vocab_size
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise APIError(400, f"token ids must be in 0..{vocab_size - 1}", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}


@router.post("/v1/completions", dependencies=AUTHED)
async def completions(body: CompletionRequest, state: ServeStateDep):
    check_common(state, body)
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens < 0 or (max_tokens == 0 and not body.echo):
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo, to score the prompt)", param="max_tokens")
    check_max_tokens(state, max_tokens, "max_tokens")
    prompts = encode_prompts(state, body.prompt)
    stop_ids = ([] if body.ignore_eos else [state.eos_id]) + list(body.stop_token_ids or [])
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
    handles = submit(state, requests, {})
    reply = CompletionReply(body, prompts, state.model_name, state.token_text)
    if not body.stream:
        return reply.whole(await collect_all(handles))
    return sse_response(reply.chunks(handles))


def chat_max_tokens(state: ServeState, body: ChatRequest, prompt_tokens: int) -> int:
    """max_completion_tokens, else max_tokens, else the rest of the context (up to the limit)."""
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(state.max_tokens_limit, state.cfg.max_seq_len - prompt_tokens))
    if max_tokens < 1:
        raise APIError(400, f"{param} must be >= 1", param=param)
    check_max_tokens(state, max_tokens, param)
    return max_tokens


@router.post("/v1/chat/completions", dependencies=AUTHED)
async def chat_completions(body: ChatRequest, state: ServeStateDep):
    check_common(state, body)
    if state.chat_stop is None:
        raise APIError(400, str(no_chat_format(state.tokenizer, "/v1/completions")), param="messages")
    prompt = encode_messages(state, body.messages)
    max_tokens = chat_max_tokens(state, body, len(prompt))
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    # Chat asks with a bool and a count; the scheduler takes the count, None for none.
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    stop_ids = ([] if body.ignore_eos else list(state.chat_stop)) + list(body.stop_token_ids or [])
    params, stops = sampling(body), stop_strings(body.stop)
    requests = [
        GenerationRequest(
            prompt,
            max_tokens,
            params,
            stop_ids,
            stops,
            None if body.seed is None else body.seed + j,
            logprobs,
            skip_special_tokens=body.skip_special_tokens,
        )
        for j in range(body.n)
    ]
    handles = submit(state, requests, {"prompt": "messages", "logprobs": "top_logprobs"})
    reply = ChatReply(body, len(prompt), set(stop_ids), logprobs, state.model_name, state.token_text)
    if not body.stream:
        return reply.whole(await collect_all(handles))
    return sse_response(reply.chunks(handles))
