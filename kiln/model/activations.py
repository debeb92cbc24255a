"""What one Transformer block keeps for backward, measured and predicted, in bytes per token.

The measurement counts every tensor autograd saves, charged at the size of its whole storage (a view
that keeps a larger buffer alive costs the buffer), each storage once. Differences over the batch and
over the depth cancel what is not per token per layer: weights and their autocast copies, the position
tables, the embedding, the final norm and the head.

The prediction follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", sec. 4.1) term by term. They count s*b*h*34 bytes per GPT layer in 16-bit without stored
attention scores: 11 for attention (QKV input 2, Q and K 4, V 2, output-projection input 2, dropout
mask 1), 19 for the MLP (input 2, GELU input 8, GELU output 8, dropout mask 1), 4 for the two
LayerNorm inputs. Kiln's dense block, per token, with b bytes per value (4 fp32, 2 under 16-bit
autocast), a heads, kv key/value heads, f the FFN hidden size:
  attention norm  its input in b (b*h) and one float32 reciprocal RMS (4)
  qkv projection  its input, the norm's output (b*h)
  SDPA            q after RoPE (b*h), k and v after RoPE (2*b*h*kv/a), its output (b*h; the output
                  projection reads the same storage, so its input costs nothing more) and one float32
                  logsumexp per head (4*a); no T x T scores (flash-style kernels)
  FFN norm        b*h + 4
  FFN input       the norm's output (b*h)
  SwiGLU          the gate (w1) and up (w3) outputs (2*b*f, read by silu and by the product), silu(gate) (b*f)
                  and the product, the down projection's input (b*f); GELU: its input and output (2*b*f)
  residual adds   nothing (their backward is the identity)
  QK-norm         (qk_norm only) the q and k norms' inputs, q and k before normalisation (b*h + b*h*kv/a)
                  and one float32 reciprocal RMS per head (4*a + 4*kv)
Sum: b*(6h + 2h*kv/a + 4f) + 4a + 8 for SwiGLU, b*(6h + 2h*kv/a + 2f) + 4a + 8 for GELU, without QK-norm. With MHA,
b = 2 and a GELU f = 4h this is 32h: Korthikanti's 34h without the two dropout masks, plus the
logsumexp and the RMS statistics. With full activation checkpointing a block keeps only its input,
the residual stream, which stays float32 under autocast over float32 weights: 4h (2h where FSDP's bf16
parameters make the stream bf16). Selective checkpointing (kiln.parallel.parallelize.selective_policy)
keeps that input and the outputs of the ops its policy saves, and recomputes the rest (the QK-norms
too, so neither checkpointing mode keeps more for them):
  block input     the residual stream (4h, as under full checkpointing)
  qkv projection  its fused output b*(h + 2h*kv/a) (kept: not of width h)
  SDPA            its output (b*h) and logsumexp (4*a)
  output proj.    nothing: of width h, recomputed from the kept SDPA output
  FFN up          SwiGLU's gate and up outputs (2*b*f), GELU's w1 output (b*f) (kept)
  FFN down        nothing: of width h, and backward never reads its output, so it is not even recomputed
Sum: 4h + b*(2h + 2h*kv/a + 2f) + 4a for SwiGLU (b*f for GELU's up projection instead of 2*b*f).

Measuring selective checkpointing needs more than saved_tensors_hooks: the outputs its policy keeps
live in checkpointing's own cache, which no hook sees (inside a checkpointed region autograd's saved
tensors go to checkpointing's hooks, not the caller's). kept_tensor_bytes therefore counts, besides
every storage autograd saves, every storage an op created during the forward that is still alive when
the forward returns; without checkpointing and with full checkpointing both counts agree.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kiln.model.config import AC_MODES, ModelConfig


def layer_activation_bytes_per_token(
    cfg: ModelConfig, value_bytes: int, mode: str = "none", residual_bytes: int = 4
) -> int:
    """Predicted bytes one dense RMSNorm block keeps for backward per token under activation
    checkpointing `mode` (none | selective | full; see the module doc). value_bytes: 4 in float32, 2
    under bf16/fp16 autocast; residual_bytes: those of the residual stream entering the block (4 under
    autocast over float32 weights, 2 with bf16 weights)."""
    if cfg.norm != "rmsnorm" or any(cfg.is_moe_layer(layer) for layer in range(cfg.n_layers)):
        raise ValueError("the activation formula covers dense RMSNorm blocks only")
    if mode not in AC_MODES:
        raise ValueError(f"mode must be one of {', '.join(AC_MODES)}, got {mode!r}")
    h, a, f = cfg.dim, cfg.n_heads, cfg.ffn_hidden_size
    kv = 2 * h * cfg.kv_heads // a
    if mode == "full":
        return residual_bytes * h
    if mode == "selective":
        up = 2 * f if cfg.ffn == "swiglu" else f
        return residual_bytes * h + value_bytes * (2 * h + kv + up) + 4 * a
    ffn = 4 * f if cfg.ffn == "swiglu" else 2 * f
    qk_norm = value_bytes * (h + kv // 2) + 4 * (a + cfg.kv_heads) if cfg.qk_norm else 0
    return value_bytes * (6 * h + kv + ffn) + 4 * a + 2 * 4 + qk_norm


class _CreatedStorages(TorchDispatchMode):
    """A weak reference to the storage of every tensor an op returns, with its size."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.storages[id(storage)] = (weakref.ref(storage), storage.nbytes())
        return out


def kept_tensor_bytes(run: Callable[[], object]) -> int:
    """Bytes of the distinct storages kept for backward while `run()` executes: those autograd saves,
    and those its ops create that are still alive once it returns (selective checkpointing's cache)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    created = _CreatedStorages()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), created:
        out = run()  # held until counted, so no kept storage is freed and its address reused
    for ref, nbytes in created.storages.values():
        storage = ref()
        if storage is not None:
            storages[storage.data_ptr()] = nbytes
    del out
    return sum(storages.values())


def measured_layer_activation_bytes_per_token(
    build: Callable[[int], torch.nn.Module],
    seq_len: int,
    vocab_size: int,
    context: Callable[[], AbstractContextManager] = nullcontext,
) -> float:
    """Bytes per token per layer that models from `build(n_layers)` keep for backward in a forward
    under `context()` (e.g. an autocast), from four runs: one and two layers, batch one and two."""
    generator = torch.Generator().manual_seed(0)
    kept = {}
    for layers in (1, 2):
        model = build(layers)
        for batch in (1, 2):
            tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=generator)
            tokens = tokens.to(model.tok_embeddings.weight.device)
            with context():
                kept[layers, batch] = kept_tensor_bytes(lambda: model(tokens))  # noqa: B023
    per_layer_per_row = kept[2, 2] - kept[1, 2] - kept[2, 1] + kept[1, 1]
    return per_layer_per_row / seq_len
