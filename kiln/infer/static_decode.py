"""A decode step with static shapes, compiled once with torch.compile (Engine(compile_decode=True),
`kiln generate --compile-decode`).

The eager engine's decode step attends over the cached keys up to the longest row (a width that grows
by one every step) and drops finished rows from the batch, so no two steps have the same shapes. Here
every step has the shapes of the first: the cache is preallocated to a bucketed length (the next power
of two, up to max_seq_len), each step attends over all of its slots with a mask of each row's length,
and finished rows stay in the batch (their tokens are computed and thrown away). Row lengths live in a
tensor, so the step reads no Python state that changes between steps, and torch.compile traces one
graph per (batch, cache length, dtype) that serves every step; the first call pays the compile.

Prefill, sampling and the stop rules stay eager: prefill runs once per request with a prompt-shaped
input, and sampling draws from per-row generators outside the graph.
"""

from __future__ import annotations

import torch
import torch._inductor.config  # the freezing flag CompiledDecoder sets; not imported by `import torch`

from kiln.errors import ConfigError
from kiln.infer.quant import PackedLinear

# torch.compile keeps at most this many graphs per code object; one per (batch, cache length, dtype).
_RECOMPILE_LIMIT = 32


def cache_length(needed: int, max_seq_len: int) -> int:
    """Slots to preallocate for a request needing `needed`: the next power of two (at least 64), at most
    max_seq_len. Buckets keep the number of compiled graphs to a handful across requests of different
    lengths; a longer cache costs only masked-out attention."""
    length = 64
    while length < needed:
        length *= 2
    return min(length, max_seq_len)


def check_compilable(model) -> None:
    """ConfigError("compile_decode") for models whose decode step cannot have static shapes."""
    if getattr(model, "encoder_decoder", False):
        raise ConfigError("compile_decode", "is for decoder-only models; a T5 decodes eagerly")
    cfg = model.cfg
    if cfg.rope_scaling is not None and cfg.rope_scaling.type == "dynamic":
        raise ConfigError(
            "compile_decode", "dynamic RoPE scaling rebuilds its frequencies for each length; decode it eagerly"
        )
    if any(cfg.is_moe_layer(layer) for layer in range(cfg.n_layers)):
        raise ConfigError("compile_decode", "MoE layers route tokens with data-dependent shapes; decode them eagerly")


class StaticStepCache:
    """The KV cache as one decode step sees it inside the compiled graph: per layer k and v [B, kv_heads,
    max_len, head_dim], and lengths [B] (a tensor), all updated in place. It has the interface
    Transformer.forward expects of a cache (prepare, layer(i).update, advance).

    Each layer's k and v are tensors of their own, not views of one [layers, ...] tensor: written
    through a view, a graph input is rebuilt whole (functionalization scatters the view back into its
    base), which copied the entire cache at every layer of every step."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], lengths: torch.Tensor):
        self.k, self.v, self.lengths = k, v, lengths
        self.max_len = k[0].shape[2]
        self._step: tuple | None = None

    def prepare(self, seq: int) -> torch.Tensor:
        # A finished row keeps stepping: clamped, it rewrites its own last slot, which nothing reads.
        start = self.lengths.clamp(max=self.max_len - seq)
        positions = start[:, None] + torch.arange(seq, device=start.device)  # [B, seq]
        mask = torch.arange(self.max_len, device=start.device) <= positions[:, :, None]  # [B, seq, max_len]
        self._step = (positions, mask.unsqueeze(1))  # broadcast over heads
        return positions

    def layer(self, layer: int) -> "_StaticLayerCache":
        return _StaticLayerCache(self, layer)

    def advance(self, seq: int) -> None:
        self.lengths.add_(seq)
        self._step = None


class _StaticLayerCache:
    def __init__(self, cache: StaticStepCache, layer: int):
        self.cache, self.index = cache, layer

    def update(self, k: torch.Tensor, v: torch.Tensor):
        positions, mask = self.cache._step
        slots = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # [B, kv_heads, T, hd]
        k_all, v_all = self.cache.k[self.index], self.cache.v[self.index]
        k_all.scatter_(2, slots, k.to(k_all.dtype))
        v_all.scatter_(2, slots, v.to(v_all.dtype))
        return k_all, v_all, {"attn_mask": mask}


class CompiledDecoder:
    """The model's decode step, compiled on first use (dynamic=False, fullgraph=True: a graph break or
    a shape that would need one fails loudly instead of running half eager). Holds one compiled
    function; torch.compile caches a graph per input shape, and the bucketed cache lengths keep those
    few. Inductor's C++ wrapper (cpp_wrapper) calls the kernels from C++ instead of a Python function:
    at one token per step the Python wrapper's per-kernel overhead is a measurable part of the step
    (docs/benchmarks.md).

    The weights of a plain model are read as graph inputs, not folded in, so the graph stays right if
    they change in place (RL rollouts); guards recompile if they are replaced. A prepacked model
    (PackedLinear layers, which cannot change in place anyway) is traced under inductor's freezing:
    its weights become graph constants, so each packed linear is a direct oneDNN call from C++
    instead of a custom op that calls back into Python (one per layer and step)."""

    def __init__(self, model, backend: str = "inductor"):
        check_compilable(model)
        self.model = model
        prepacked = any(isinstance(m, PackedLinear) for m in model.modules())
        self._freezing = torch._inductor.config.patch(freezing=True) if prepacked else None
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _RECOMPILE_LIMIT)
        options = {"cpp_wrapper": True} if backend == "inductor" else None
        self._step = torch.compile(self._forward, backend=backend, dynamic=False, fullgraph=True, options=options)

    def _forward(self, tokens: torch.Tensor, lengths: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]):
        return self.model(tokens, kv_cache=StaticStepCache(k, v, lengths))[:, -1].float()

    def step(self, tokens: torch.Tensor, lengths: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]):
        if self._freezing is None:
            return self._step(tokens, lengths, k, v)
        # Every call, not only the first: dynamo reads the flag while it traces and guards on it, so a
        # call without it would retrace the graph unfrozen. The patch costs ~5-10 us of a ~4 ms step.
        with self._freezing:
            return self._step(tokens, lengths, k, v)

    def start(self, cache) -> "StaticDecode":
        """Decode from a prefilled KVCache (its keys and values are copied, once, into per-layer tensors)."""
        return StaticDecode(self, cache)


class StaticDecode:
    """One request batch's decode: the prefilled cache and each row's length as a tensor."""

    def __init__(self, decoder: CompiledDecoder, cache):
        self.decoder = decoder
        # On the CPU the keys and values are kept in float32 whatever the model's dtype: attention for
        # one query runs 5-7x faster in float32 than in bf16 there (docs/benchmarks.md).
        dtype = torch.float32 if cache.k.device.type == "cpu" else cache.k.dtype
        self.k = [k.to(dtype, copy=True) for k in cache.k.unbind(0)]
        self.v = [v.to(dtype, copy=True) for v in cache.v.unbind(0)]
        self.lengths = torch.tensor(cache.lengths, device=cache.k.device)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, 1] (one per row, finished rows included) -> float32 logits [B, vocab]."""
        return self.decoder.step(tokens, self.lengths, self.k, self.v)
