"""Encoder-decoder decoding state for the engine (kiln.infer.engine): the prompt goes through the
encoder once, each decoder layer's cross-attention keys and values are computed from its output
once, and only the decoder's self-attention cache grows, one slot per generated token."""

from __future__ import annotations

from typing import Sequence

import torch


class Seq2SeqCache:
    """A decoder self-attention KVCache plus, per decoder layer, the cross-attention k and v
    [B, heads, S, head_dim] of the encoder output and its padding mask [B, S]. T5.decode(tokens,
    kv_cache=cache) reads the cross part and appends to the self part; rows leave together."""

    def __init__(self, self_cache, cross_kv: list[tuple[torch.Tensor, torch.Tensor]], memory_mask: torch.Tensor):
        self.self_cache, self.cross_kv, self.memory_mask = self_cache, cross_kv, memory_mask

    @property
    def lengths(self) -> list[int]:
        return self.self_cache.lengths

    @property
    def batch(self) -> int:
        return self.self_cache.batch

    def prepare(self, seq: int) -> torch.Tensor:
        return self.self_cache.prepare(seq)

    def advance(self, seq: int) -> None:
        self.self_cache.advance(seq)

    def layer(self, layer: int):
        return self.self_cache.layer(layer)

    def cross(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cross_kv[layer]

    def keep(self, rows: Sequence[int]) -> None:
        self.self_cache.keep(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.memory_mask.device)
        self.cross_kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.cross_kv]
        self.memory_mask = self.memory_mask.index_select(0, index)


def prefill_seq2seq(model, prompts: list[list[int]], max_new_tokens: int, make_cache):
    """Encode the right-padded prompts once and run the decoder's start token: (cache, logits
    [B, vocab] after the start token, decoder tokens [B, 1]). make_cache(n_layers, batch, max_len)
    builds the self-attention cache (kiln.infer.kv_cache.KVCache)."""
    cfg = model.cfg
    device = next(model.parameters()).device
    batch, longest = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((batch, longest), cfg.pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(batch, longest, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, device=device)
        mask[row, : len(prompt)] = True
    memory = model.encode(tokens, mask)
    # The start token and every generated token but the last take a slot.
    self_cache = make_cache(cfg.decoder_layers, batch, min(cfg.max_seq_len, max_new_tokens))
    cache = Seq2SeqCache(self_cache, model.cross_kv(memory), mask)
    start = torch.full((batch, 1), cfg.pad_id, dtype=torch.long, device=device)
    logits = model.decode(start, kv_cache=cache)[:, -1].float()
    return cache, logits, start
