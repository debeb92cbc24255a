"""The OpenAI request bodies the server accepts and the pieces of its responses.

Field names, defaults and shapes follow OpenAI's API as vLLM implements it (completions: max_tokens
16, temperature 1, top_p 1; logprobs at most 20; the first echoed prompt token's logprob is null).
Fields clients send that Kiln cannot honour (penalties, logit_bias, tools, response_format, ...)
are declared so that a value other than the neutral one is refused with a 400 naming the field,
rather than silently ignored; fields nobody declared are ignored, as vLLM does.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """Answered as an OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _first_unusable(value, path: tuple) -> tuple[tuple, str] | None:
    """(path, problem) of the first number that is not finite or string with a lone surrogate in a
    parsed JSON value; None when every leaf can be used."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, f"{value} is not a finite number")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return path, f"has a lone surrogate (U+{ord(value[err.start]):04X}) at character {err.start}"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _first_unusable(key, path + (key,)) or _first_unusable(item, path + (key,))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _first_unusable(item, path + (i,))
            if found:
                return found
    return None


def check_json_body(body: bytes) -> None:
    """Refuse, naming the field, a JSON body that holds NaN, Infinity or -Infinity (Python's parser
    accepts the literals, and a number too large for a float parses as inf) or a string with a lone
    surrogate (JSON's \\ud800 escape; no tokenizer can encode it). Either would reach sampling or the
    tokenizer and fail there. A body that is not JSON is left to the request's own parsing."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return
    found = _first_unusable(parsed, ())
    if found is not None:
        path, problem = found
        param = ".".join(str(p) for p in path) or None
        raise APIError(400, f"{param or 'body'}: {problem}", param=param)


def internal_error(err: Exception) -> APIError:
    """The 500 of a failure the server did not expect, naming it."""
    return APIError(500, f"internal error: {type(err).__name__}: {err}", type="server_error")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer, as APIError.body() writes it (declared in the OpenAPI schema)."""

    error: ErrorDetail


ERROR_STATUSES = {
    400: "invalid request",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body too large",
    429: "server busy",
    500: "generation failed",
    503: "the model is not running",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    model: str | None = None
    temperature: float | None = Field(None, description="1.0 when unset; 0 is greedy")
    top_p: float | None = Field(None, description="1.0 when unset (off)")
    n: int = Field(1, description="choices per prompt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    # torch seeds are 64-bit; the range is vLLM's (a signed long), so seed + i still fits.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="choice i of a prompt samples with seed + i")
    # Accepted at their neutral value only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters, which the engine has.
    top_k: int = Field(0, description="0: off")
    min_p: float = Field(0.0, description="0: off")
    # Bounded so that logits divided or multiplied by it stay finite in float32 (with temperature
    # >= 1e-5, the server's greedy floor).
    repetition_penalty: float = Field(1.0, ge=1e-6, le=1e6, description="1: off (CTRL's penalty, as transformers)")
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = Field(
        True,
        description="leave special tokens (<|user|>, ...) out of the text, "
        "as vLLM and transformers' decode do by default",
    )

    def unsupported(self) -> list[tuple[str, Any]]:
        out = []
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            if getattr(self, name) != neutral:
                out.append((name, getattr(self, name)))
        if self.logit_bias:
            out.append(("logit_bias", self.logit_bias))
        return out


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, token ids, or a list of either (one choice group per prompt)"
    )
    max_tokens: int | None = Field(16, description="0 is allowed with echo (score the prompt only)")
    logprobs: int | None = Field(None, description="chosen token's logprob plus the top k (k <= 20)")
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, Any]]:
        out = super().unsupported()
        if self.best_of not in (None, 1, self.n):
            out.append(("best_of", self.best_of))
        if self.suffix:
            out.append(("suffix", self.suffix))
        return out


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, description="deprecated name of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, description="default: the rest of the context")
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def unsupported(self) -> list[tuple[str, Any]]:
        out = super().unsupported()
        if self.tools:
            out.append(("tools", "tool calling"))
        if self.tool_choice not in (None, "none", "auto"):
            out.append(("tool_choice", self.tool_choice))
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            out.append(("response_format", self.response_format.get("type")))
        return out


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = Field(False, description="Kiln's tokenizer adds none either way")


class DetokenizeRequest(_Body):
    tokens: list[int]


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages to the {"role", "content"} dicts kiln.data.chat renders. A "developer"
    message is OpenAI's newer name for a system message; text parts of a content list are joined."""
    out = []
    for i, m in enumerate(messages):
        if m.tool_calls:
            raise APIError(400, f"messages[{i}]: tool calls are not supported", param="messages")
        role = "system" if m.role == "developer" else m.role
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"messages[{i}]: content part of type {part.type!r} is not supported (text only)",
                        param="messages",
                    )
                texts.append(part.text)
            content = "".join(texts)
        out.append({"role": role, "content": content})
    return out


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class TokenText:
    """Per-token strings for logprobs, cached: decoding one id alone gives its own text (a token
    holding part of a multi-byte character shows as U+FFFD, as in vLLM)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token])
        return text

    def offsets(self, ids: list[int], start: int = 0) -> list[int]:
        """Character offset of each token in the decoded text of ids (plus start). Text is decoded
        from the last point where it was whole, so a character split over tokens counts once."""
        out, clean_at, clean_len = [], 0, start
        for i in range(len(ids)):
            piece = self.tokenizer.decode(ids[clean_at:i]) if i > clean_at else ""
            out.append(clean_len + len(piece))
            if not piece.endswith("\ufffd"):
                clean_at, clean_len = i, clean_len + len(piece)
        return out


def completion_logprobs(
    token_text: TokenText,
    ids: list[int],
    logprobs: list[float | None],
    tops: list[list[tuple[int, float]] | None],
    text_start: int = 0,
) -> dict:
    """The legacy completions logprobs object. Each top_logprobs dict holds the top k tokens and
    always the chosen one (up to k + 1 entries, as OpenAI documents); None where logprob is None."""
    top_dicts = []
    for token, lp, top in zip(ids, logprobs, tops):
        if lp is None:
            top_dicts.append(None)
            continue
        entry = {token_text(t): v for t, v in (top or [])}
        entry.setdefault(token_text(token), lp)
        top_dicts.append(entry)
    return {
        "tokens": [token_text(t) for t in ids],
        "token_logprobs": list(logprobs),
        "top_logprobs": top_dicts,
        "text_offset": token_text.offsets(ids, text_start),
    }


def chat_logprob_entry(
    token_text: TokenText,
    token: int,
    logprob: float,
    top: list[tuple[int, float]] | None,
) -> dict:
    def one(t: int, lp: float) -> dict:
        text = token_text(t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {**one(token, logprob), "top_logprobs": [one(t, v) for t, v in (top or [])]}
