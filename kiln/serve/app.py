"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions (streamed over
server-sent events when asked), /health, lm-eval's remote-tokenizer endpoints (/tokenizer_info,
/tokenize, /detokenize), the chat page at /, and FastAPI's /openapi.json and /docs.

create_app builds one app per model: its ServeState, the error handlers and the body limit here, the
routes from kiln.serve.routes. Requests become GenerationRequests for the continuous-batching
Scheduler (one per choice); its thread runs the model while the event loop keeps answering. Every
failure a client can cause is a 4xx with an OpenAI error body, and never stops the server. See
docs/serve.md.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kiln.errors import ConfigError
from kiln.serve.prefix_cache import from_megabytes
from kiln.serve.protocol import ERROR_STATUSES, APIError, ErrorResponse, internal_error
from kiln.serve.routes import ServeState, router
from kiln.serve.scheduler import Scheduler

log = logging.getLogger(__name__)


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
                # FastAPI re-raises an HTTPException from reading the body; http_error_response
                # turns it into the error body.
                raise HTTPException(413, too_large.message)
            return message

        return await self.app(scope, limited, send)


class InternalErrors:
    """Answer an unexpected exception with a 500 in the OpenAI error shape and keep the connection.
    Starlette's handler for Exception re-raises after answering, and uvicorn then closes the
    keep-alive connection, so the client's next request on it would be reset."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as err:
            if started:
                raise  # half a response is out: only closing the connection can end it
            log.exception("request failed")
            await JSONResponse(internal_error(err).body(), 500)(scope, receive, send)


async def api_error_response(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), err.status)


async def validation_error_response(request: Request, err: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 answered as OpenAI's 400, naming the first bad field."""
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        message = f"request body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')})"
        return JSONResponse(APIError(400, message).body(), 400)
    param = ".".join(loc) or None
    message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
    return JSONResponse(APIError(400, message, param=param).body(), 400)


async def http_error_response(request: Request, err: HTTPException) -> JSONResponse:
    body = APIError(err.status_code, str(err.detail), code="request_too_large" if err.status_code == 413 else None)
    return JSONResponse(body.body(), err.status_code, headers=getattr(err, "headers", None))


@asynccontextmanager
async def run_scheduler(app: FastAPI):
    """The app's lifespan: the scheduler's thread runs from startup to shutdown."""
    state: ServeState = app.state.serve
    # Also on app.state.scheduler, where callers (and the tests) read its load and stats.
    state.scheduler = app.state.scheduler = Scheduler(
        state.model,
        state.tokenizer,
        state.max_batch,
        state.max_waiting,
        state.max_prefill_tokens,
        prefix_cache=state.prefix_cache,
        prefill_chunk_tokens=state.prefill_chunk_tokens,
    )
    try:
        yield
    finally:
        state.scheduler.close()


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
    prefix_cache_mb: float | None = None,
    prefill_chunk_tokens: int = 0,
    chat_trained: bool = True,
) -> FastAPI:
    """The app for one model. api_keys: when given, /v1/* and the tokenizer endpoints need
    `Authorization: Bearer <key>`. max_tokens_limit (default: the model's context) caps a request's
    max_tokens; max_batch rows decode together and max_waiting more requests queue (then 429).
    prefix_cache_mb: MiB of prompt-prefix keys and values kept for reuse (kiln.serve.prefix_cache;
    None: its default, 0: off). prefill_chunk_tokens: prompts longer than this prefill in chunks of
    that many tokens between decode steps (kiln.serve.scheduler; 0: off). chat_trained False: the chat page notes that the model has had no
    chat training."""
    limit = model.cfg.max_seq_len if max_tokens_limit is None else max_tokens_limit
    if any(v < 1 for v in (limit, max_body_bytes)):
        raise ConfigError("max_tokens_limit" if limit < 1 else "max_body_bytes", "must be >= 1")
    prefix_cache = from_megabytes(model, prefix_cache_mb)  # refused here, before the server starts
    keys = [k.encode() for k in api_keys if k]
    state = ServeState(
        model=model,
        tokenizer=tokenizer,
        model_name=model_name,
        api_keys=keys,
        max_tokens_limit=limit,
        max_batch=max_batch,
        max_waiting=max_waiting,
        max_prefill_tokens=max_prefill_tokens,
        prefix_cache=prefix_cache,
        prefill_chunk_tokens=prefill_chunk_tokens,
        chat_trained=chat_trained,
    )
    # Every route declares the error answers, so clients and schema-driven tests know their shape.
    errors = {status: {"model": ErrorResponse, "description": text} for status, text in ERROR_STATUSES.items()}
    app = FastAPI(
        title="Kiln", summary="OpenAI-compatible server for a Kiln model", lifespan=run_scheduler, responses=errors
    )
    app.state.serve = state
    app.add_exception_handler(APIError, api_error_response)
    app.add_exception_handler(RequestValidationError, validation_error_response)
    app.add_exception_handler(HTTPException, http_error_response)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(InternalErrors)
    app.include_router(router)
    return app
