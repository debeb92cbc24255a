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
  SwiGLU          the fused gate|up output (2*b*f, read by silu and by the product), silu(gate) (b*f)
                  and the product, the down projection's input (b*f); GELU: its input and output (2*b*f)
  residual adds   nothing (their backward is the identity)
Sum: b*(6h + 2h*kv/a + 4f) + 4a + 8 for SwiGLU, b*(6h + 2h*kv/a + 2f) + 4a + 8 for GELU. With MHA,
b = 2 and a GELU f = 4h this is 32h: Korthikanti's 34h without the two dropout masks, plus the
logsumexp and the RMS statistics. With full activation checkpointing a block keeps only its input,
the residual stream, which stays float32 under autocast: 4h.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from kiln.model.config import ModelConfig


def layer_activation_bytes_per_token(cfg: ModelConfig, value_bytes: int, checkpointed: bool = False) -> int:
    """Predicted bytes one dense RMSNorm block keeps for backward per token (see the module doc).
    value_bytes: 4 in float32, 2 under bf16/fp16 autocast."""
    if cfg.norm != "rmsnorm" or any(cfg.is_moe_layer(layer) for layer in range(cfg.n_layers)):
        raise ValueError("the activation formula covers dense RMSNorm blocks only")
    h, a, f = cfg.dim, cfg.n_heads, cfg.ffn_hidden_size
    if checkpointed:
        return 4 * h  # the float32 residual stream entering the block
    ffn = 4 * f if cfg.ffn == "swiglu" else 2 * f
    return value_bytes * (6 * h + 2 * h * cfg.kv_heads // a + ffn) + 4 * a + 2 * 4


def saved_tensor_bytes(run: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves for backward while `run()` executes."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()  # held until counted, so no saved storage is freed and its address reused
    total = sum(storages.values())
    del out
    return total


def measured_layer_activation_bytes_per_token(
    build: Callable[[int], torch.nn.Module],
    seq_len: int,
    vocab_size: int,
    context: Callable[[], AbstractContextManager] = nullcontext,
) -> float:
    """Bytes per token per layer that models from `build(n_layers)` save in a forward under `context()`
    (e.g. an autocast), from four runs: one and two layers, batch one and two."""
    generator = torch.Generator().manual_seed(0)
    saved = {}
    for layers in (1, 2):
        model = build(layers)
        for batch in (1, 2):
            tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=generator)
            tokens = tokens.to(model.tok_embeddings.weight.device)
            with context():
                saved[layers, batch] = saved_tensor_bytes(lambda: model(tokens))  # noqa: B023
    per_layer_per_row = saved[2, 2] - saved[1, 2] - saved[2, 1] + saved[1, 1]
    return per_layer_per_row / seq_len
