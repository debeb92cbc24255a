"""Chunked prefill for the scheduler (Scheduler(prefill_chunk_tokens=N), `kiln serve
--prefill-chunk-tokens N`): prompts longer than N tokens are prefilled N tokens per loop iteration,
together as one group in a cache of their own, while the running rows take a decode step between
the chunks. A prompt whose last chunk is done leaves the group (KVCache.split) and joins the running
batch; the others go on. One group is in flight at a time: long prompts that arrive meanwhile wait
for it, short ones are admitted as usual. A mixin of kiln.serve.scheduler.Scheduler, whose methods
(_reused, _new_cache, _store_prefixes, _prefilled, _fail) and state it uses."""

from __future__ import annotations

import torch

from kiln.infer.kv_cache import KVCache
from kiln.serve.requests import Handle

NOTHING = ([], None, None)  # no rows, no cache, no logits


class ChunkGroup:
    """Long prompts prefilled together: their handles, their cache (made at the first chunk), the
    prompt tokens each row has in it, and each row's chunk logits when it asked for prompt_logprobs."""

    def __init__(self, handles: list[Handle]):
        self.handles = handles
        self.cache: KVCache | None = None
        self.done: list[int] = []
        self.logits: list[list[torch.Tensor]] = [[] for _ in handles]

    def add(self, handle: Handle) -> None:
        self.handles.append(handle)
        self.logits.append([])

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), in the cache too once there is one."""
        self.handles = [self.handles[i] for i in rows]
        self.logits = [self.logits[i] for i in rows]
        if self.cache is not None:
            self.done = [self.done[i] for i in rows]
            self.cache.keep(rows)

    def split_off(self, rows: list[int]) -> KVCache:
        """These rows leave the group: their cache (KVCache.split); the others stay, in order."""
        cache, leaving = self.cache.split(rows), set(rows)
        stay = [i for i in range(len(self.handles)) if i not in leaving]
        self.handles = [self.handles[i] for i in stay]
        self.logits = [self.logits[i] for i in stay]
        self.done = [self.done[i] for i in stay]
        return cache


class ChunkedPrefilling:
    def _chunking_rows(self) -> int:
        """Rows of the chunked groups, which count against max_batch like running rows."""
        return sum(len(group.handles) for group in self._groups)

    def _prefill_chunk(self):
        """The next chunk of the group in flight. Returns the rows whose prompts it completed, their
        cache and next-token logits (or no rows). When a chunk's forward fails, each request of a
        group of several is prefilled again alone, and one that fails alone gets the error."""
        group = self._groups[0]
        live = [i for i, h in enumerate(group.handles) if not h.cancelled]
        if len(live) < len(group.handles) and live:
            group.keep(live)
        if not live:
            self._groups.popleft()
            return NOTHING
        try:
            return self._advance(group)
        except Exception as err:
            self.stats["failures"] += 1
            self._groups.popleft()
            if len(group.handles) == 1:
                self._fail(group.handles[0], err)
            else:
                self._groups.extendleft(ChunkGroup([h]) for h in reversed(group.handles))
            return NOTHING

    def _advance(self, group: ChunkGroup):
        requests = [h.request for h in group.handles]
        lengths = [len(r.prompt) for r in requests]
        if group.cache is None:
            reused = self._reused(requests)
            # A row's last token is sampled but never fed back, so it needs no slot.
            need = max(min(self.model.cfg.max_seq_len, n + r.max_tokens - 1) for n, r in zip(lengths, requests))
            group.cache, group.done = self._new_cache(requests, reused, max(max(lengths), need)), list(reused)
        take = [min(self.prefill_chunk_tokens, n - d) for n, d in zip(lengths, group.done)]
        # Every row writes `width` slots after its own length, so the longest row must have them.
        width = min(max(take), group.cache.max_len - max(group.done))
        take = [min(t, width) for t in take]
        tokens = torch.zeros(len(requests), width, dtype=torch.long, device=self.device)
        for i, (r, d, t) in enumerate(zip(requests, group.done, take)):
            tokens[i, :t] = torch.tensor(r.prompt[d : d + t], device=self.device)
        # Right-padded rows (only those finishing here take fewer than width tokens): the padding
        # goes past their length, is never attended to and is overwritten by their next tokens.
        group.cache.set_lengths(group.done)
        logits = self.model(tokens, kv_cache=group.cache)
        group.done = [d + t for d, t in zip(group.done, take)]
        group.cache.set_lengths(group.done)
        self.stats["prefill_chunks"] += 1
        for i, r in enumerate(requests):
            if r.prompt_logprobs:
                group.logits[i].append(logits[i, : take[i]])
        complete = [i for i, (d, n) in enumerate(zip(group.done, lengths)) if d == n]
        if not complete:
            return NOTHING
        at = torch.tensor([take[i] - 1 for i in complete], device=self.device)
        last = logits[torch.tensor(complete, device=self.device), at].float()
        handles = [group.handles[i] for i in complete]
        prompt_logits = [torch.cat(group.logits[i]) if requests[i].prompt_logprobs else None for i in complete]
        if len(complete) == len(requests):
            cache = group.cache
            self._groups.popleft()
        else:
            cache = group.split_off(complete)
        self.stats["prefills"] += 1
        self._store_prefixes([h.request for h in handles], cache)
        return self._prefilled(handles, cache, prompt_logits, last)
