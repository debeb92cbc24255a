"""Continuous batching: one background thread runs the model over every active request, and new
requests join the running batch between decode steps instead of waiting for it to drain.

Each loop iteration admits waiting requests (up to max_batch rows, and about max_prefill_tokens of
padded prompt per prefill), prefills them in a cache of their own and appends its rows to the
running cache (KVCache.extend), then samples one token for every row, sends it to its request, and
drops the rows that finished (KVCache.keep) before the next decode forward. Rows keep their own
lengths and positions, so a request's tokens do not depend on which other requests share the batch:
with the same seed they are the tokens Engine.stream gives for it alone (sampling is the engine's
own `kiln.infer.sampling.sample_next_tokens`, one call per group of rows with equal sampling
parameters, each row drawing from its own generator).

With a prefix cache (kiln.serve.prefix_cache), a new prompt's stored prefix is copied into its
row's cache slots and only the rest of the prompt is forwarded.

With prefill_chunk_tokens, prompts longer than that are prefilled in chunks of that many tokens, one
chunk per loop iteration, while the running rows go on decoding between chunks
(kiln.serve.chunked_prefill). Without it, a long prompt's prefill holds every running row for its
whole length.

A request that fails on its own (its prefill, sampling or text) gets the error and leaves the batch;
the others go on unchanged. Only a failure of the batched decode forward fails every row.

Requests are submitted from any thread; their events come back through a Handle that is iterated
either synchronously (`for event in handle`) or from an asyncio loop (`async for`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Sequence

import torch

from kiln.errors import ConfigError
from kiln.infer.config import SamplingParams
from kiln.infer.engine import TextStream, WithoutSpecialTokens
from kiln.infer.kv_cache import KVCache
from kiln.infer.sampling import sample_next_tokens
from kiln.serve.chunked_prefill import ChunkedPrefilling, ChunkGroup
from kiln.serve.prefix_cache import DYNAMIC_ROPE, PrefixCache, fit_prefixes, keys_depend_on_length
from kiln.serve.requests import (
    DONE,
    MAX_LOGPROBS,
    Busy,
    GenerationRequest,
    Handle,
    PromptScores,
    SchedulerError,
    TokenEvent,
)

log = logging.getLogger(__name__)


class _Row:
    """A request in the running batch."""

    def __init__(self, handle: Handle, tokenizer, vocab: int, device):
        request = handle.request
        self.handle, self.request = handle, request
        self.stop_ids = {int(t) for t in request.stop_token_ids}
        if tokenizer is not None and request.skip_special_tokens:
            tokenizer = WithoutSpecialTokens(tokenizer)
        self.text = TextStream(tokenizer, request.stop_strings) if tokenizer is not None else None
        self.generated = 0
        self.seen = None
        if request.params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[torch.tensor(request.prompt, device=device)] = True
        seed = request.seed if request.seed is not None else int(torch.randint(0, 2**62, ()).item())
        self.generator = torch.Generator(device=device).manual_seed(seed)


class Scheduler(ChunkedPrefilling):
    """Continuous batching over a kiln Transformer. max_batch: rows decoded together; max_waiting:
    requests queued behind them before submit raises Busy; max_prefill_tokens: padded prompt
    tokens prefilled in one forward (at least one request is always admitted); prefix_cache: reuse
    the keys and values of stored prompt prefixes (kiln.serve.prefix_cache), None: off;
    prefill_chunk_tokens: prompts longer than this prefill that many tokens per step between decode
    steps (0: off, every prompt in one forward)."""

    def __init__(
        self,
        model,
        tokenizer=None,
        max_batch: int = 32,
        max_waiting: int = 256,
        max_prefill_tokens: int = 8192,
        prefix_cache: PrefixCache | None = None,
        prefill_chunk_tokens: int = 0,
    ):
        for key, value in (("max_batch", max_batch), ("max_prefill_tokens", max_prefill_tokens)):
            if value < 1:
                raise ConfigError(key, f"must be >= 1, got {value}")
        for key, value in (("max_waiting", max_waiting), ("prefill_chunk_tokens", prefill_chunk_tokens)):
            if value < 0:
                raise ConfigError(key, f"must be >= 0, got {value}")
        if prefix_cache is not None and keys_depend_on_length(model.cfg):
            raise ConfigError("prefix_cache", DYNAMIC_ROPE)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.prefix_cache = prefix_cache
        self.max_batch, self.max_waiting, self.max_prefill_tokens = max_batch, max_waiting, max_prefill_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._groups: deque[ChunkGroup] = deque()  # long prompts being prefilled chunk by chunk, in order
        self.device = next(model.parameters()).device
        self._pending: deque[Handle] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._active = 0
        # Counters for tests and /health: joined_running counts requests admitted while other rows
        # were mid-generation, which is what continuous batching is for.
        # failures: forwards (prefill or decode) that failed; row_failures: requests that failed alone.
        # prefill_chunks: forwards of a chunked prefill (its completion also counts in prefills).
        names = (
            "steps",
            "prefills",
            "prefill_chunks",
            "tokens",
            "joined_running",
            "max_rows",
            "failures",
            "row_failures",
        )
        self.stats = dict.fromkeys(names, 0)
        self._thread = threading.Thread(target=self._run, name="kiln-scheduler", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing

    @property
    def load(self) -> tuple[int, int]:
        """(rows in the running batch, requests waiting)."""
        return self._active, len(self._pending)

    def check(self, request: GenerationRequest) -> None:
        """Raise ConfigError naming the field if the request cannot run."""
        cfg = self.model.cfg
        request.params.validate()  # refuses NaN and inf too: a NaN would fail the draw (on a GPU, the process)
        if request.max_tokens < 0:
            raise ConfigError("max_tokens", f"must be >= 0, got {request.max_tokens}")
        if not request.prompt:
            raise ConfigError("prompt", "is empty; give at least one token")
        if min(request.prompt) < 0 or max(request.prompt) >= cfg.vocab_size:
            raise ConfigError("prompt", f"has token ids outside 0..{cfg.vocab_size - 1}")
        room = cfg.max_seq_len - (1 if request.max_tokens > 0 else 0)
        if len(request.prompt) > room:
            raise ConfigError(
                "prompt",
                f"has {len(request.prompt)} tokens; this model's context is {cfg.max_seq_len} "
                "tokens and generation needs at least one more",
            )
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
            raise ConfigError("logprobs", f"must be in 0..{MAX_LOGPROBS}, got {request.logprobs}")
        if request.stop_strings and self.tokenizer is None:
            raise ConfigError("stop", "stop strings need a tokenizer")

    def submit(
        self,
        requests: Sequence[GenerationRequest],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> list[Handle]:
        """Queue requests together (all or none); their handles, in order. Raises ConfigError for a
        bad request and Busy when the queue has no room for all of them."""
        for request in requests:
            self.check(request)
        handles = [Handle(r, loop) for r in requests]
        with self._cond:
            if self._closing:
                raise SchedulerError("the scheduler is stopped")
            if len(self._pending) + len(handles) > self.max_waiting + max(0, self.max_batch - self._active):
                raise Busy(f"{self._active} requests running and {len(self._pending)} waiting; try again later")
            self._pending.extend(handles)
            self._cond.notify()
        return handles

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)

    # ---- the loop (scheduler thread) ----------------------------------------------------------------

    def _run(self) -> None:
        rows: list[_Row] = []
        cache, logits = None, None
        while True:
            with self._cond:
                while not self._pending and not rows and not self._groups and not self._closing:
                    self._cond.wait()
                if self._closing:
                    stopped = [r.handle for r in rows] + list(self._pending)
                    stopped += [h for group in self._groups for h in group.handles]
                    self._pending.clear()
                    break
                new = self._admit(len(rows))
            try:
                with torch.inference_mode():
                    rows, cache, logits = self._step(rows, cache, logits, new)
            except Exception as err:  # the batched decode forward failed: no row can go on without it
                log.exception("scheduler step failed")
                self.stats["failures"] += 1
                failed = SchedulerError(f"generation failed: {type(err).__name__}: {err}")
                for handle in [r.handle for r in rows] + new:
                    handle.put(failed)
                rows, cache, logits = [], None, None
            self._active = len(rows)
        for handle in stopped:
            handle.put(SchedulerError("the server is shutting down"))

    def _admit(self, running: int) -> list[Handle]:
        """The waiting requests that prefill this iteration. Long prompts (prefill_chunk_tokens)
        become a chunked group instead, of up to max_prefill_tokens / prefill_chunk_tokens of them,
        if no group is in flight; else they, and what waits behind them, wait."""
        new: list[Handle] = []
        longest = 0
        chunk = self.prefill_chunk_tokens
        forming = ChunkGroup([]) if chunk and not self._groups else None
        busy = running + self._chunking_rows()
        while self._pending and busy + len(new) + (len(forming.handles) if forming else 0) < self.max_batch:
            handle = self._pending[0]
            if handle.cancelled:
                self._pending.popleft()
                continue
            if 0 < chunk < len(handle.request.prompt):
                # A group holds at least one prompt, and at most max_prefill_tokens of chunk rows.
                if forming is None or (
                    forming.handles and (len(forming.handles) + 1) * chunk > self.max_prefill_tokens
                ):
                    break
                forming.add(self._pending.popleft())
                continue
            padded = (len(new) + 1) * max(longest, len(handle.request.prompt))
            if new and padded > self.max_prefill_tokens:
                break
            longest = max(longest, len(handle.request.prompt))
            new.append(self._pending.popleft())
        if forming is not None and forming.handles:
            self._groups.append(forming)
        return new

    def _step(self, rows, cache, logits, new):
        """One iteration: drop cancelled rows, admit new ones, sample a token for every row, and
        run the decode forward for the rows still going."""
        alive = [i for i, r in enumerate(rows) if not r.handle.cancelled]
        if len(alive) < len(rows):
            rows, logits = [rows[i] for i in alive], logits[alive] if alive else None
            if alive:
                cache.keep(alive)
            else:
                cache = None
        new = [h for h in new if not h.cancelled]
        if new:
            if rows:
                self.stats["joined_running"] += len(new)
            rows, cache, logits = _joined((rows, cache, logits), self._prefill_isolated(new))
        if self._groups:
            finished = self._prefill_chunk()
            if finished[0] and rows:
                self.stats["joined_running"] += len(finished[0])
            rows, cache, logits = _joined((rows, cache, logits), finished)
        self._active = len(rows)
        self.stats["max_rows"] = max(self.stats["max_rows"], len(rows))
        if not rows:
            return [], None, None
        self.stats["steps"] += 1
        self.stats["tokens"] += len(rows)
        next_ids, keep = self._sample(rows, logits)
        if not keep:
            return [], None, None
        if len(keep) < len(rows):
            cache.keep(keep)
            rows, next_ids = [rows[i] for i in keep], [next_ids[i] for i in keep]
        tokens = torch.tensor(next_ids, device=self.device)[:, None]
        return rows, cache, self.model(tokens, kv_cache=cache)[:, -1].float()

    def _fail(self, handle: Handle, err: Exception) -> None:
        """One request failed on its own: it gets the error, its batch carries on without it."""
        log.exception("request failed in the scheduler", exc_info=err)
        self.stats["row_failures"] += 1
        handle.put(SchedulerError(f"generation failed: {type(err).__name__}: {err}"))

    def _prefill_isolated(self, handles: list[Handle]):
        """_prefill; when the forward of a group of prompts fails, each prompt again alone, so the
        one that cannot run fails by itself (the running rows are not touched: the new prompts
        prefill in a cache of their own)."""
        try:
            return self._prefill(handles)
        except Exception as err:
            self.stats["failures"] += 1
            if len(handles) == 1:
                self._fail(handles[0], err)
                return [], None, None
        batch = ([], None, None)
        for handle in handles:
            batch = _joined(batch, self._prefill_isolated([handle]))
        return batch

    def _prefill(self, handles: list[Handle]):
        """Run the new prompts through the model in a cache of their own. Returns the rows that go
        on generating, their cache and their next-token logits; prompt-only requests end here. The
        forward is batched; what follows is per request, and a request that fails there fails alone.
        Nothing is sent to any request before the forward has succeeded."""
        requests = [h.request for h in handles]
        lengths = [len(r.prompt) for r in requests]
        max_seq_len = self.model.cfg.max_seq_len
        reused = self._reused(requests)
        # Each row forwards the rest of its prompt after its reused prefix (slots [:reused]),
        # right-padded to the longest rest; fit_prefixes kept that within the context.
        width = max(n - p for n, p in zip(lengths, reused))
        # A row's last token is sampled but never fed back, so it needs no slot.
        need = max(min(max_seq_len, n + r.max_tokens - 1) for n, r in zip(lengths, requests))
        cache = self._new_cache(requests, reused, max(max(reused) + width, need))
        tokens = torch.zeros(len(requests), width, dtype=torch.long, device=self.device)
        for i, (r, p) in enumerate(zip(requests, reused)):
            tokens[i, : lengths[i] - p] = torch.tensor(r.prompt[p:], device=self.device)
        # Rows at different lengths: KVCache.prepare masks each row's queries to its own keys.
        cache.set_lengths(reused)
        all_logits = self.model(tokens, kv_cache=cache)
        cache.set_lengths(lengths)
        self.stats["prefills"] += 1
        self._store_prefixes(requests, cache)
        at = torch.tensor([n - p - 1 for n, p in zip(lengths, reused)], device=self.device)  # last prompt token
        last = all_logits[torch.arange(len(requests), device=self.device), at].float()
        prompt_logits = [all_logits[i, :n] for i, n in enumerate(lengths)]  # no reuse with prompt_logprobs
        return self._prefilled(handles, cache, prompt_logits, last)

    def _new_cache(self, requests: list[GenerationRequest], reused: list[int], max_len: int) -> KVCache:
        """A cache of max_len slots for the requests, holding each one's reused prefix."""
        cache = KVCache.for_model(self.model, len(requests), max_len)
        for i, (r, p) in enumerate(zip(requests, reused)):
            if p:
                cache.k[:, i, :, :p], cache.v[:, i, :, :p] = self.prefix_cache.take(r.prompt, p)
            elif self.prefix_cache is not None and not r.prompt_logprobs:
                self.prefix_cache.take(r.prompt, 0)  # a miss
        return cache

    def _store_prefixes(self, requests: list[GenerationRequest], cache: KVCache) -> None:
        if self.prefix_cache is not None:
            for i, r in enumerate(requests):
                self.prefix_cache.store(r.prompt, cache.k[:, i], cache.v[:, i])

    def _prefilled(self, handles: list[Handle], cache: KVCache, prompt_logits: list, last: torch.Tensor):
        """After a prefill's forward: each request's prompt scores (if asked) and its row, or its end
        (prompt only). Returns the rows that go on, their cache and next-token logits (last [B, vocab]);
        a request that fails here fails alone."""
        vocab = self.model.cfg.vocab_size
        going, rows = [], []
        for i, handle in enumerate(handles):
            request = handle.request
            try:
                scores = self._prompt_scores(prompt_logits[i], request) if request.prompt_logprobs else None
                row = _Row(handle, self.tokenizer, vocab, self.device) if request.max_tokens > 0 else None
            except Exception as err:
                self._fail(handle, err)
                continue
            if scores is not None:
                handle.put(scores)
            if row is None:
                handle.put(DONE)
            else:
                going.append(i)
                rows.append(row)
        if not going:
            return [], None, None
        if len(going) < len(handles):
            cache.keep(going)
        return rows, cache, last[torch.tensor(going, device=self.device)]

    def _reused(self, requests: list[GenerationRequest]) -> list[int]:
        """Per request, the tokens of its prompt whose keys and values come from the prefix cache.
        A request with prompt_logprobs reuses none: it needs the logits at every prompt position."""
        if self.prefix_cache is None:
            return [0] * len(requests)
        found = [0 if r.prompt_logprobs else self.prefix_cache.match(r.prompt) for r in requests]
        lengths = [len(r.prompt) for r in requests]
        return fit_prefixes(lengths, found, self.model.cfg.max_seq_len, self.prefix_cache.block)

    @staticmethod
    def _prompt_scores(logits: torch.Tensor, request: GenerationRequest) -> PromptScores:
        """logits [T, vocab] at the prompt's positions: position t predicts token t + 1."""
        logprobs = logits.float().log_softmax(dim=-1)
        prompt = torch.tensor(request.prompt[1:], device=logits.device)
        chosen = logprobs[:-1].gather(1, prompt[:, None])[:, 0].tolist()
        k = request.logprobs or 0
        tops: list = [None]
        if k > 0 and len(request.prompt) > 1:
            values, ids = logprobs[:-1].topk(k, dim=-1)
            tops += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            tops += [[] for _ in chosen]
        return PromptScores([None] + chosen, tops)

    def _draw(self, rows: list[_Row], logits: torch.Tensor, idx: list[int], new: list, logprob: list) -> None:
        """The next token and its logprob of rows idx (all with the same sampling parameters), in
        one call, into new and logprob."""
        params = rows[idx[0]].request.params
        index = torch.tensor(idx, device=self.device)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.stack([rows[i].seen for i in idx])
        tokens, lps, _, _ = sample_next_tokens(logits[index], params, seen, [rows[i].generator for i in idx])
        for i, token, lp in zip(idx, tokens, lps):
            new[i], logprob[i] = token, lp

    def _draw_isolated(self, rows: list[_Row], logits: torch.Tensor) -> tuple[list, list, dict[int, Exception]]:
        """Every row's next token and logprob, one call per group of rows with equal sampling
        parameters, and {row index: error} of the rows that could not be sampled. A group whose call
        raises is drawn again row by row, each generator back at its state before the group's call,
        so a row that fails alone takes no other row with it and the others draw what they would
        have."""
        groups: dict[SamplingParams, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(row.request.params, []).append(i)
        new: list = [0] * len(rows)
        logprob: list = [0.0] * len(rows)
        failed: dict[int, Exception] = {}
        for params, idx in groups.items():
            states = [rows[i].generator.get_state() for i in idx] if params.temperature != 0 else None
            try:
                self._draw(rows, logits, idx, new, logprob)
                continue
            except Exception:
                pass
            for j, i in enumerate(idx):
                if states is not None:
                    rows[i].generator.set_state(states[j])
                try:
                    self._draw(rows, logits, [i], new, logprob)
                except Exception as err:
                    failed[i] = err
        return new, logprob, failed

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Sample each row's next token, send it, and return (tokens, indices of unfinished rows).
        A row whose sampling or text fails gets its error and leaves the batch; the others go on."""
        new, logprob, failed = self._draw_isolated(rows, logits)
        tops = self._top_logprobs(rows, logits, new, logprob, failed)
        keep = []
        for i, row in enumerate(rows):
            if i not in failed:
                try:
                    finish = self._send(row, new[i], logprob[i], tops[i])
                except Exception as err:
                    failed[i] = err
                else:
                    if finish is None:
                        keep.append(i)
                    continue
            self._fail(row.handle, failed[i])
        return new, keep

    def _send(self, row: _Row, token: int, logprob: float, top) -> str | None:
        """Send the row its new token (with the text it completes) and return its finish reason."""
        request = row.request
        if row.seen is not None:
            row.seen[token] = True
        row.generated += 1
        piece, finish = "", None
        if token in row.stop_ids:
            finish = "stop"
        elif row.text is not None:
            piece, stop = row.text.push(token)
            finish = "stop" if stop is not None else None
        if finish is None and (
            row.generated == request.max_tokens or len(request.prompt) + row.generated >= self.model.cfg.max_seq_len
        ):
            finish = "length"
        if finish is not None and row.text is not None:
            piece += row.text.finish()
        row.handle.put(TokenEvent(token, piece, logprob, top, finish))
        if finish is not None:
            row.handle.put(DONE)
        return finish

    def _top_logprobs(self, rows, logits, new, logprob, failed) -> list:
        """Top-k (id, logprob) per row that asked for logprobs. The chosen token's logprob is taken
        from the same tensor, so a greedy token equals the best top entry exactly (lm-eval's
        is_greedy test compares them with ==)."""
        tops: list = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.request.logprobs is not None and i not in failed]
        if not want:
            return tops
        index = torch.tensor(want, device=self.device)
        lsm = logits[index].log_softmax(dim=-1)
        chosen = lsm.gather(1, torch.tensor([new[i] for i in want], device=self.device)[:, None])[:, 0].tolist()
        k = max(rows[i].request.logprobs for i in want)
        values, ids = lsm.topk(k, dim=-1) if k > 0 else (None, None)
        for j, i in enumerate(want):
            logprob[i] = chosen[j]
            n = rows[i].request.logprobs
            tops[i] = list(zip(ids[j, :n].tolist(), values[j, :n].tolist())) if n > 0 else []
        return tops


def _joined(running: tuple, new: tuple) -> tuple:
    """(rows, cache, logits) of a running batch with newly prefilled rows appended after its own."""
    rows, cache, logits = running
    new_rows, new_cache, new_logits = new
    if not new_rows:
        return running
    if not rows:
        return new
    cache.extend(new_cache)
    return rows + new_rows, cache, torch.cat([logits, new_logits])
