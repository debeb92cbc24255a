"""The KV cache every decoder generation in Kiln runs on: keys and values of every layer for a batch
of rows, allocated once, with each row's own length (kiln.infer.engine explains why rows are laid
out with per-row lengths rather than left padding)."""

from __future__ import annotations

from typing import Sequence

import torch


def encoder_decoder(model) -> bool:
    """A T5 (kiln.model.t5): the prompt is encoded once and the decoder generates from its start token."""
    return getattr(model, "encoder_decoder", False)


class KVCache:
    """Keys and values of every layer for a batch of rows: k and v [layers, B, kv_heads, max_len,
    head_dim], allocated once, and each row's length (how many slots hold its tokens).

    Transformer.forward(tokens, kv_cache=cache) appends tokens [B, T] after each row's cached tokens
    and advances every row by T; a caller that right-padded rows of different lengths then sets the
    true lengths with set_lengths."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device=None,
    ):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        # On the host: the shapes of the next step depend on them, and reading them from the device
        # would wait for the GPU at every step.
        self.lengths: list[int] = [0] * batch
        self._layers = [_LayerCache(self, layer) for layer in range(n_layers)]
        self._step: tuple | None = None

    @staticmethod
    def nbytes(model, batch: int, max_len: int) -> int:
        """Bytes of the keys and values a cache of `batch` rows of `max_len` tokens allocates for `model`."""
        cfg, param = model.cfg, next(model.parameters())
        # A T5's decoder self-attention cache (its cross-attention k/v hold one slot per prompt token).
        layers, heads = (cfg.decoder_layers, cfg.n_heads) if encoder_decoder(model) else (cfg.n_layers, cfg.kv_heads)
        return 2 * layers * batch * heads * max_len * cfg.head_dim * param.element_size()

    @classmethod
    def for_model(cls, model, batch: int, max_len: int | None = None) -> "KVCache":
        cfg = model.cfg
        max_len = cfg.max_seq_len if max_len is None else max_len
        if not 0 < max_len <= cfg.max_seq_len:
            raise ValueError(f"KV cache max_len must be in 1..max_seq_len={cfg.max_seq_len}, got {max_len}")
        param = next(model.parameters())
        return cls(cfg.n_layers, batch, cfg.kv_heads, max_len, cfg.head_dim, param.dtype, param.device)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def layer(self, layer: int) -> "_LayerCache":
        return self._layers[layer]

    def prepare(self, seq: int) -> torch.Tensor:
        """Plan a step that appends seq tokens to every row; returns their positions [B, seq]."""
        longest, shortest = max(self.lengths), min(self.lengths)
        if longest + seq > self.max_len:
            raise ValueError(f"KV cache full: a row holds {longest} tokens, {seq} more exceed max_len={self.max_len}")
        device = self.k.device
        positions = torch.tensor(self.lengths, device=device)[:, None] + torch.arange(seq, device=device)
        width = longest + seq  # keys any row can see this step
        if longest == shortest:
            write = slice(longest, width)
            if seq == 1:
                masking = {}  # one query per row, every cached key is before it
            elif longest == 0:
                masking = {"is_causal": True}  # queries and keys both start at slot 0
            else:
                masking = {"attn_mask": torch.arange(width, device=device) <= positions[0, :, None]}
        else:
            # Rows at different lengths: row b's query t sits at slot lengths[b] + t and sees the
            # keys up to it; the slots of longer rows beyond that are masked out.
            rows = torch.arange(self.batch, device=device)[:, None].expand(-1, seq)
            write = (rows, positions)
            mask = torch.arange(width, device=device) <= positions[:, :, None]  # [B, T, width]
            masking = {"attn_mask": mask.unsqueeze(1)}  # broadcast over heads
        self._step = (write, width, masking)
        return positions

    def advance(self, seq: int) -> None:
        self.lengths = [length + seq for length in self.lengths]
        self._step = None

    def set_lengths(self, lengths: Sequence[int]) -> None:
        if len(lengths) != self.batch or not all(0 <= n <= self.max_len for n in lengths):
            raise ValueError(f"need {self.batch} lengths in 0..{self.max_len}, got {list(lengths)}")
        self.lengths = list(lengths)

    def _rows(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Copies of these rows' keys and values, and their lengths."""
        index = torch.tensor(rows, dtype=torch.long, device=self.k.device)
        return self.k.index_select(1, index), self.v.index_select(1, index), [self.lengths[r] for r in rows]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these rows (in this order): finished requests stop costing compute."""
        self.k, self.v, self.lengths = self._rows(rows)

    def split(self, rows: Sequence[int]) -> "KVCache":
        """Move these rows (in this order) into a new cache with the same slot count; the others stay
        here, in their order. A chunked prefill's finished prompts leave the ones still prefilling."""
        if self._step is not None:
            raise RuntimeError("KVCache.split between steps only (after advance)")
        layers, _, heads, _, head_dim = self.k.shape
        out = KVCache(layers, 0, heads, self.max_len, head_dim, self.k.dtype, self.k.device)
        out.k, out.v, out.lengths = self._rows(rows)
        moved = set(rows)
        self.keep([r for r in range(self.batch) if r not in moved])
        return out

    def extend(self, other: "KVCache") -> None:
        """Append the rows of `other` (prefilled on their own) after this cache's rows, keeping their
        lengths: a server's new requests join the running batch between decode steps. Rows start at
        slot 0 whatever batch they are in, so no row moves; the slot count becomes the larger one."""
        if self._step is not None or other._step is not None:
            raise RuntimeError("KVCache.extend between steps only (after advance)")

        def layout(k: torch.Tensor) -> tuple:  # everything but the batch and slot counts
            return k.shape[0], k.shape[2], k.shape[4], k.dtype, k.device

        if layout(self.k) != layout(other.k):
            raise ValueError(
                f"KV caches differ: {tuple(self.k.shape)} {self.k.dtype} {self.k.device} vs "
                f"{tuple(other.k.shape)} {other.k.dtype} {other.k.device}"
            )
        max_len = max(self.max_len, other.max_len)

        def slots(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, 0, 0, max_len - t.shape[3])) if t.shape[3] < max_len else t

        self.k = torch.cat([slots(self.k), slots(other.k)], dim=1)
        self.v = torch.cat([slots(self.v), slots(other.v)], dim=1)
        self.max_len = max_len
        self.lengths = self.lengths + other.lengths


class _LayerCache:
    """One layer's view of the cache, handed to Attention.forward."""

    def __init__(self, cache: KVCache, layer: int):
        self.cache, self.index = cache, layer

    def update(self, k: torch.Tensor, v: torch.Tensor):
        """k, v [B, kv_heads, T, head_dim] of the new tokens -> all keys and values the step can
        see [B, kv_heads, width, head_dim] and the masking arguments for SDPA."""
        cache = self.cache
        if cache._step is None:
            raise RuntimeError("KVCache.prepare(seq) must run before the layers use the cache")
        write, width, masking = cache._step
        k_all, v_all = cache.k[self.index], cache.v[self.index]
        if isinstance(write, slice):
            k_all[:, :, write] = k
            v_all[:, :, write] = v
        else:
            rows, slots = write  # indices on dims 0 and 2 put [B, T] first: [B, T, kv_heads, head_dim]
            k_all[rows, :, slots] = k.transpose(1, 2)
            v_all[rows, :, slots] = v.transpose(1, 2)
        return k_all[:, :, :width], v_all[:, :, :width], masking
