"""The judges of `kiln judge` (kiln/post/judge.py): each takes chat conversations that ask "A or B?"
and returns one Verdict per conversation.

- `KilnJudge`: a Kiln model. The verdict is whichever of the tokens "A" and "B" the model gives the
  higher log-probability as the first token of its reply; deterministic, nothing is sampled.
- `OpenAIJudge`: any model behind an OpenAI-compatible chat completions API (`kiln serve`, vLLM, a
  hosted model), through the official `openai` client, an optional dependency imported when used.
  It asks for one token at temperature 0 with log-probabilities: when the reply's top alternatives
  hold both letters, their log-probabilities decide as for KilnJudge; when they hold one, it wins
  (the other is less likely than every listed token); otherwise the reply's text must be the letter
  A or B (either case, surrounding spaces ignored). Anything else is an invalid verdict,
  counted by reason, never an exception; so is a request the server refuses (HTTP 4xx other than
  auth and unknown model, or a 5xx after the client's retries). A server that cannot be reached, a
  refused key and an unknown model stop the run with a ConfigError naming the key to fix.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from kiln.data.chat import render_prompt
from kiln.errors import ConfigError

LETTERS = ("A", "B")
TOP_LOGPROBS = 20  # alternatives asked for the one reply token: the most the OpenAI API allows


@dataclass(frozen=True)
class Verdict:
    """One judgement of one order: "A", "B", "tie" or "invalid"."""

    choice: str
    margin: float | None = None  # log p("A") - log p("B"), where the backend gives log-probabilities
    reason: str = ""  # why the verdict is invalid (unparseable, too_long, http_400, ...)


class Judge(Protocol):
    def judge(self, conversations: Sequence[list[dict]]) -> list[Verdict]: ...


def verdict_from_margin(margin: float, tie_margin: float) -> Verdict:
    if abs(margin) <= tie_margin:
        return Verdict("tie", margin)
    return Verdict("A" if margin > 0 else "B", margin)


class KilnJudge:
    """A Kiln model as judge, scored by its log-probability of replying "A" versus "B"."""

    def __init__(self, model, tokenizer, tie_margin: float = 0.0, batch_size: int = 8):
        self.model, self.tokenizer, self.tie_margin, self.batch_size = model, tokenizer, tie_margin, batch_size
        self.letter_ids = [verdict_token(tokenizer, letter) for letter in LETTERS]

    @torch.no_grad()
    def judge(self, conversations: Sequence[list[dict]]) -> list[Verdict]:
        ids = [render_prompt(self.tokenizer, c) for c in conversations]
        verdicts: list[Verdict | None] = [None] * len(ids)
        fits = []
        for i, seq in enumerate(ids):
            if len(seq) > self.model.cfg.max_seq_len:
                verdicts[i] = Verdict("invalid", reason="too_long")
            else:
                fits.append(i)
        pad = self.tokenizer.token_id("<|pad|>")
        device = next(self.model.parameters()).device
        a, b = self.letter_ids
        for start in range(0, len(fits), self.batch_size):
            chunk = fits[start : start + self.batch_size]
            width = max(len(ids[i]) for i in chunk)
            # Right padding: attention is causal, so the pads never reach the last real position.
            batch = torch.tensor([ids[i] + [pad] * (width - len(ids[i])) for i in chunk], device=device)
            last = torch.tensor([len(ids[i]) - 1 for i in chunk], device=device)
            logits = self.model(batch)[torch.arange(len(chunk), device=device), last].float()
            logp = torch.log_softmax(logits, dim=-1)
            for i, margin in zip(chunk, (logp[:, a] - logp[:, b]).tolist()):
                verdicts[i] = verdict_from_margin(margin, self.tie_margin)
        return verdicts


def verdict_token(tokenizer, letter: str) -> int:
    ids = tokenizer.encode(letter, parse_special=False)
    if len(ids) != 1:
        raise ConfigError(
            "judge.tokenizer", f"spells the verdict {letter!r} as {len(ids)} tokens; the judge reads one token"
        )
    return ids[0]


def _openai():
    try:
        import openai
    except ImportError:
        raise ConfigError(
            "judge.backend", "the openai backend needs the `openai` package (pip install openai)"
        ) from None
    return openai


class OpenAIJudge:
    """A model behind an OpenAI-compatible API as judge (one letter at temperature 0)."""

    def __init__(self, client, model: str, tie_margin: float = 0.0, api_key_env: str = "OPENAI_API_KEY"):
        self.openai = _openai()
        self.client, self.model, self.tie_margin, self.api_key_env = client, model, tie_margin, api_key_env
        self.logprobs = True  # cleared once the server refuses log-probs and answers without them

    @classmethod
    def from_config(cls, cfg) -> "OpenAIJudge":
        """base_url from judge.base_url, else $OPENAI_BASE_URL, else the client's default; the key
        from the environment variable judge.api_key_env (a local server may need none)."""
        openai = _openai()
        base_url = cfg.base_url or os.environ.get("OPENAI_BASE_URL") or None
        client = openai.OpenAI(base_url=base_url, api_key=os.environ.get(cfg.api_key_env) or "none")
        return cls(client, cfg.model, cfg.tie_margin, cfg.api_key_env)

    def judge(self, conversations: Sequence[list[dict]]) -> list[Verdict]:
        return [self._judge_one(messages) for messages in conversations]

    def _judge_one(self, messages: list[dict]) -> Verdict:
        openai = self.openai
        try:
            reply = self._ask(messages)
        except openai.APIConnectionError as err:
            raise ConfigError("judge.base_url", f"{self.client.base_url}: cannot reach the server ({err})") from None
        except (openai.AuthenticationError, openai.PermissionDeniedError) as err:
            raise ConfigError(
                "judge.api_key_env", f"the server refused the key in ${self.api_key_env} ({err.status_code})"
            ) from None
        except openai.NotFoundError as err:
            raise ConfigError(
                "judge.model", f"{self.model!r}: not found at {self.client.base_url} ({err.message})"
            ) from None
        except openai.APIStatusError as err:
            return Verdict("invalid", reason=f"http_{err.status_code}")
        return parse_reply(reply, self.tie_margin)

    def _ask(self, messages: list[dict]):
        request = {"model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0}
        if self.logprobs:
            try:
                return self.client.chat.completions.create(**request, logprobs=True, top_logprobs=TOP_LOGPROBS)
            except self.openai.BadRequestError:
                # Maybe the server refuses log-probs (not every one gives them for chat): the same
                # request without them decides, and if it is answered the judge stops asking.
                reply = self.client.chat.completions.create(**request)
                self.logprobs = False
                return reply
        return self.client.chat.completions.create(**request)


def parse_reply(reply, tie_margin: float) -> Verdict:
    """The verdict of a chat completion asked for one letter."""
    if not reply.choices:
        return Verdict("invalid", reason="no_choice")
    choice = reply.choices[0]
    scores = letter_logprobs(choice.logprobs)
    if len(scores) == len(LETTERS):
        return verdict_from_margin(scores["A"] - scores["B"], tie_margin)
    if scores:  # one letter is among the most likely tokens and the other is not: it is the likelier
        return Verdict(next(iter(scores)))
    text = (choice.message.content or "").strip().upper()
    if text in LETTERS:
        return Verdict(text)
    return Verdict("invalid", reason="unparseable")


def letter_logprobs(logprobs) -> dict[str, float]:
    """{"A": log p, "B": log p} of the letters among the first reply token and its top alternatives
    (a letter spelt with a space or in lower case counts as the letter, at its best log-prob)."""
    if logprobs is None or not logprobs.content:
        return {}
    first = logprobs.content[0]
    scores: dict[str, float] = {}
    for entry in [first, *(first.top_logprobs or [])]:
        letter = entry.token.strip().upper()
        if letter in LETTERS and math.isfinite(entry.logprob):
            scores[letter] = max(scores.get(letter, -math.inf), entry.logprob)
    return scores
