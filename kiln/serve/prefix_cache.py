"""Prefix caching for the serving scheduler: the keys and values of prompt prefixes that earlier
prefills computed, so that a new prompt starting with one (a shared system prompt, few-shot
examples, a conversation's earlier turns) forwards only the rest of its tokens.

A prefix's keys and values depend only on its tokens (attention is causal and every row starts at
position 0: kiln.infer.engine), so the stored ones are exactly what a new prefill would compute.
Prefixes are kept in blocks of `block` tokens: after a prefill, the first floor((n - 1) / block) *
block tokens of an n-token prompt are stored, never the whole prompt, because at least one token
must still be forwarded to give the logits of the next one. A lookup finds the longest stored
block-aligned prefix of a prompt. Each stored entry is a copy of its own (nothing is shared between
entries or with the batch's cache, so evicting or growing one never touches another); an entry
that is a prefix of a new one is dropped, the new one serves both. The budget is in bytes, and the
least recently used entries go first when it is exceeded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from kiln.errors import ConfigError

# On by default, as vLLM's prefix caching is. A separate budget rather than a share of the running
# KV cache (Kiln's is not paged), and filled only as prefixes are stored. 256 MiB holds about 2,000
# tokens of a Llama-3-8B's bf16 keys and values (a few system prompts or few-shot headers), 8,000 of
# a 1B's and 30,000 of the CPU demo's tiny model: small next to the weights it serves (16 GB for 8B).
DEFAULT_MB = 256.0
BLOCK = 16  # vLLM's default block size
DYNAMIC_ROPE = (
    "cannot be used with dynamic RoPE scaling: past the original context a key depends on the length "
    "of the forward that computed it, so a stored one differs from what a new prefill computes"
)


def keys_depend_on_length(cfg) -> bool:
    """Whether a token's keys depend on the forward that computes them (kiln.model.rope.rotation)."""
    return cfg.rope_scaling is not None and cfg.rope_scaling.type == "dynamic"


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    hashes: list[int]  # the chain hash after each of its blocks: _chain(tokens)
    k: torch.Tensor  # [layers, kv_heads, len(tokens), head_dim]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class PrefixCache:
    """An LRU cache of prompt prefixes' keys and values, at most budget_bytes in all."""

    def __init__(self, budget_bytes: int, block: int = BLOCK):
        if budget_bytes < 1:
            raise ConfigError("budget_bytes", f"must be >= 1, got {budget_bytes}")
        if block < 1:
            raise ConfigError("block", f"must be >= 1, got {block}")
        self.budget, self.block = budget_bytes, block
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id, least recently used first
        # Chain hash of a block-aligned prefix -> ids of the entries that start with it.
        self._holders: dict[int, set[int]] = {}
        self._next_id = 0
        # hits/misses: lookups of prefilled prompts that reused a prefix or found none; tokens_reused:
        # prompt tokens not forwarded thanks to the cache; evictions: entries dropped for the budget.
        self.stats = dict.fromkeys(("hits", "misses", "tokens_reused", "entries", "bytes", "evictions"), 0)

    def _chain(self, prompt: Sequence[int], blocks: int) -> Iterator[int]:
        """Hashes of prompt's first 1, 2, ... `blocks` blocks, each from the one before and its
        block's tokens, so finding a prompt's longest prefix reads each token once."""
        h = 0
        for j in range(blocks):
            h = hash((h, tuple(prompt[j * self.block : (j + 1) * self.block])))
            yield h

    def _holder(self, prompt: Sequence[int], blocks: int, h: int) -> int | None:
        """The id of an entry that starts with prompt's first `blocks` blocks (chain hash h), tokens
        checked: a hash collision is a miss, never another prompt's keys."""
        n = blocks * self.block
        for i in self._holders.get(h, ()):
            if self._entries[i].tokens[:n] == tuple(prompt[:n]):
                return i
        return None

    def match(self, prompt: Sequence[int]) -> int:
        """Tokens of prompt's longest stored prefix: a multiple of block, at most len(prompt) - 1."""
        found, h = 0, 0
        for j, h_j in enumerate(self._chain(prompt, (len(prompt) - 1) // self.block), 1):
            if h_j not in self._holders:
                break  # an entry holding a longer prefix would hold this one too
            found, h = j, h_j
        return found * self.block if found and self._holder(prompt, found, h) is not None else 0

    def take(self, prompt: Sequence[int], n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored keys and values [layers, kv_heads, n, head_dim] of prompt[:n] (n a block
        multiple up to match(prompt); views, to be copied), counted as a hit and marked recently
        used; n = 0 counts a miss and returns None."""
        if n == 0:
            self.stats["misses"] += 1
            return None
        blocks = n // self.block
        i = self._holder(prompt, blocks, list(self._chain(prompt, blocks))[-1]) if n % self.block == 0 else None
        if i is None:
            raise ValueError(f"no stored prefix of {n} tokens for this prompt")
        self._entries.move_to_end(i)
        entry = self._entries[i]
        self.stats["hits"] += 1
        self.stats["tokens_reused"] += n
        return entry.k[:, :, :n], entry.v[:, :, :n]

    def store(self, prompt: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep the keys and values of prompt's block-aligned prefix, at most len(prompt) - 1 tokens
        (fewer when the budget holds fewer). k, v [layers, kv_heads, slots, head_dim]: a prefilled
        row of the batch's cache, its first len(prompt) slots the prompt's."""
        per_block = 2 * k[:, :, :1].nbytes * self.block
        blocks = min((len(prompt) - 1) // self.block, self.budget // per_block)
        if blocks == 0:
            return
        hashes = list(self._chain(prompt, blocks))
        held = self._holder(prompt, blocks, hashes[-1])
        if held is not None:  # this prefix (or a longer one starting with it) is stored already
            self._entries.move_to_end(held)
            return
        n = blocks * self.block
        entry = _Entry(tuple(prompt[:n]), hashes, k[:, :, :n].clone(), v[:, :, :n].clone())
        for j, h in enumerate(hashes[:-1], 1):  # stored prefixes of the new entry: it serves them
            for i in list(self._holders.get(h, ())):
                if len(self._entries[i].hashes) == j:
                    self._remove(i)
        self._add(entry)
        while self.stats["bytes"] > self.budget:
            self._remove(next(iter(self._entries)))  # never the new entry: it fits the budget alone
            self.stats["evictions"] += 1

    def _add(self, entry: _Entry) -> None:
        i, self._next_id = self._next_id, self._next_id + 1
        self._entries[i] = entry
        for h in entry.hashes:
            self._holders.setdefault(h, set()).add(i)
        self.stats["entries"] += 1
        self.stats["bytes"] += entry.nbytes

    def _remove(self, i: int) -> None:
        entry = self._entries.pop(i)
        for h in entry.hashes:
            holders = self._holders[h]
            holders.discard(i)
            if not holders:
                del self._holders[h]
        self.stats["entries"] -= 1
        self.stats["bytes"] -= entry.nbytes


def fit_prefixes(lengths: Sequence[int], reused: Sequence[int], context: int, block: int) -> list[int]:
    """The reused prefix lengths, cut so that the batched prefill fits the context: each row's rest
    is right-padded to the longest rest, after the row's own prefix, so the batch needs max(reused)
    + max(length - reused) slots. A row whose prefix is too long gives back whole blocks; reusing
    nothing always fits (every prompt fits the context)."""
    reused = list(reused)
    while max(reused) + max(n - p for n, p in zip(lengths, reused)) > context:
        room = context - max(n - p for n, p in zip(lengths, reused))
        cap = max(0, room) // block * block
        reused = [min(p, cap) if p > room else p for p in reused]
    return reused


def from_megabytes(model, mb: float | None, block: int = BLOCK) -> PrefixCache | None:
    """The cache for `kiln serve --prefix-cache-mb` / create_app(prefix_cache_mb=): None asks for
    DEFAULT_MB (off for a model with dynamic RoPE scaling, which cannot use one), 0 is off."""
    if mb is None:
        mb = 0.0 if keys_depend_on_length(model.cfg) else DEFAULT_MB
    if not mb >= 0:  # NaN too
        raise ConfigError("prefix_cache_mb", f"must be >= 0 (0 is off), got {mb}")
    if mb == 0:
        return None
    if keys_depend_on_length(model.cfg):
        raise ConfigError("prefix_cache_mb", DYNAMIC_ROPE + "; give 0")
    budget = int(mb * 2**20)
    if budget < 1:
        raise ConfigError("prefix_cache_mb", f"{mb} MiB is less than a byte; give 0 for off")
    return PrefixCache(budget, block)
