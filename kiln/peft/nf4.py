"""4-bit NormalFloat (NF4) weights with double quantisation, in plain PyTorch (QLoRA, Dettmers et al. 2023).

A frozen weight is flattened and cut into blocks of `block_size` (64) values. Each block is divided by
its absolute maximum and every value is replaced by the index of the nearest of 16 NF4 levels; two
4-bit indices share a byte. With double quantisation the per-block absmax scalers are themselves
quantised: their mean is subtracted and each group of 256 is stored as int8 with one float32 factor
per group (torchao's `double_quantize_scalers` scheme; bitsandbytes uses an 8-bit dynamic map there
instead, which the anchors note differs slightly). Storage per parameter:

    4 + 8/64 + 32/(64*256) = 4.127 bits   (double quantisation)
    4 + 32/64              = 4.5 bits     (float32 absmax per block)

Why not torchao's NF4Tensor: it needs numel divisible by block_size * 256 (16384), which the small
matrices of CPU-sized models often are not, and it is an extra dependency whose compiled parts warn on
CPU-only machines. This module pads ragged blocks and groups instead and needs nothing beyond torch;
tests/peft/test_qlora.py checks its codes and scalers bit for bit against torchao's `to_nf4`.

Error bound: the level chosen for w/absmax is the nearest, so |w - level*absmax| is at most half the
widest gap between neighbouring levels (0.1519, between -1 and -0.6962) times the block absmax. Double
quantisation adds at most |level| * (absmax error) <= group_range/128 (rounding to 1/256 of the group's
range, or one full step where +128 is clamped to 127). `error_bound` returns this per element.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# bitsandbytes' NF4 levels: quantiles of N(0, 1) scaled to [-1, 1], asymmetric so that 0 is exact.
NF4_LEVELS = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
SCALER_BLOCK_SIZE = 256


def _pad_to(t: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    extra = -t.numel() % multiple
    return F.pad(t, (0, extra), value=value) if extra else t


def _nearest_level(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level (ties to the lower one), via the midpoints between levels."""
    midpoints = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(x, midpoints, right=False)


def quantize_nf4(
    weight: torch.Tensor,
    block_size: int = 64,
    double_quant: bool = True,
    scaler_block_size: int = SCALER_BLOCK_SIZE,
    levels=NF4_LEVELS,
) -> dict[str, torch.Tensor]:
    """Quantise any-shaped `weight` (math in float32) to the tensors dequantize_nf4 reads back.

    Keys: codes (uint8, two indices per byte, first in the high nibble as torchao packs them), and
    either scalers (float32 absmax per block) or, with double_quant, scalers_q (int8), scaler_factor
    (float32 per group of scaler_block_size) and scaler_mean (float32 scalar)."""
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size must be a positive even number, got {block_size}")
    w = weight.detach().float().flatten()
    table = torch.tensor(levels, dtype=torch.float32, device=w.device)
    blocks = _pad_to(w, block_size).view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    # An all-zero block has absmax 0; dividing by 1 instead still maps every value to level 0.0.
    normalised = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax)).unsqueeze(1)
    idx = _nearest_level(normalised.flatten(), table).to(torch.uint8)
    out = {"codes": (idx[0::2] << 4) | idx[1::2]}
    if not double_quant:
        out["scalers"] = absmax
        return out
    mean = absmax.mean()
    # Padding with the mean makes the padded scalers 0 after centring, so they cannot widen a group's range.
    centred = _pad_to(absmax, scaler_block_size, value=mean.item()).view(-1, scaler_block_size) - mean
    group_absmax = centred.abs().amax(dim=1)
    # 256 / (2 * absmax) maps the group onto [-128, 128]; a group of identical scalers needs no scale.
    factor = torch.where(group_absmax > 0, 128.0 / group_absmax, torch.ones_like(group_absmax))
    q = (centred * factor.unsqueeze(1)).round().clamp(-128, 127).to(torch.int8)
    out.update(scalers_q=q.flatten()[: absmax.numel()].contiguous(), scaler_factor=factor, scaler_mean=mean)
    return out


def dequantize_scalers(parts: dict[str, torch.Tensor], scaler_block_size: int = SCALER_BLOCK_SIZE) -> torch.Tensor:
    if "scalers" in parts:
        return parts["scalers"]
    q = parts["scalers_q"]
    factor = parts["scaler_factor"].repeat_interleave(scaler_block_size)[: q.numel()]
    return q.float() / factor + parts["scaler_mean"]


def _pair_table(levels, device) -> torch.Tensor:
    """[256, 2]: the two levels a packed byte stands for, so unpacking is a single gather."""
    table = torch.tensor(levels, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack([table[byte >> 4], table[byte & 15]], dim=1)


def dequantize_nf4(
    parts: dict[str, torch.Tensor],
    shape,
    dtype=torch.float32,
    block_size: int = 64,
    scaler_block_size: int = SCALER_BLOCK_SIZE,
    levels=NF4_LEVELS,
) -> torch.Tensor:
    codes = parts["codes"]
    values = _pair_table(levels, codes.device)[codes.long()].view(-1, block_size)
    scalers = dequantize_scalers(parts, scaler_block_size)
    numel = math.prod(shape)
    return (values * scalers.unsqueeze(1)).flatten()[:numel].view(shape).to(dtype)


def error_bound(
    weight: torch.Tensor,
    parts: dict[str, torch.Tensor],
    block_size: int = 64,
    scaler_block_size: int = SCALER_BLOCK_SIZE,
) -> torch.Tensor:
    """Per-element upper bound on |weight - dequantize_nf4(parts)| (see the module docstring)."""
    w = weight.detach().float().flatten()
    absmax = _pad_to(w, block_size).view(-1, block_size).abs().amax(dim=1)
    levels = torch.tensor(NF4_LEVELS)
    half_gap = ((levels[1:] - levels[:-1]).max() / 2).item()
    per_block = half_gap * absmax
    if "scalers_q" in parts:
        # One quantisation step of the scaler (1/factor) covers rounding (half a step) and the clamp of +128.
        step = (1.0 / parts["scaler_factor"]).repeat_interleave(scaler_block_size)[: absmax.numel()]
        per_block = per_block + step
    # float32 rounding of the products; relative, far below the quantisation error itself.
    per_block = per_block * (1 + 1e-6) + 1e-12
    return per_block.repeat_interleave(block_size)[: w.numel()].view(weight.shape)


def storage_bits(parts: dict[str, torch.Tensor]) -> int:
    return 8 * sum(t.numel() * t.element_size() for t in parts.values())


class _NF4Matmul(torch.autograd.Function):
    """x @ W^T with W dequantised on the fly in forward and again in backward, so no full-precision
    copy of the frozen weight stays alive between the two (the memory saving QLoRA is for)."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return F.linear(x, module.dequantize(_compute_dtype(x)))

    @staticmethod
    def backward(ctx, grad_out):
        weight = ctx.module.dequantize(grad_out.dtype)
        return grad_out @ weight, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class NF4Linear(nn.Module):
    """A frozen nn.Linear whose weight is stored in NF4; the bias (if any) stays a frozen float tensor.

    The quantised tensors are persistent buffers, so a checkpoint of a QLoRA run stores the base at
    ~4.1 bits per parameter and reloads without re-quantising."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        block_size: int = 64,
        double_quant: bool = True,
        dtype=torch.float32,
        device=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block_size, self.double_quant = block_size, double_quant
        self.weight_dtype = dtype  # what dequantize() returns by default: the original weight's dtype
        n_blocks = -(-in_features * out_features // block_size)
        self.register_buffer("codes", torch.zeros(n_blocks * block_size // 2, dtype=torch.uint8, device=device))
        if double_quant:
            n_groups = -(-n_blocks // SCALER_BLOCK_SIZE)
            self.register_buffer("scalers_q", torch.zeros(n_blocks, dtype=torch.int8, device=device))
            self.register_buffer("scaler_factor", torch.ones(n_groups, dtype=torch.float32, device=device))
            self.register_buffer("scaler_mean", torch.zeros((), dtype=torch.float32, device=device))
        else:
            self.register_buffer("scalers", torch.zeros(n_blocks, dtype=torch.float32, device=device))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, block_size: int = 64, double_quant: bool = True) -> "NF4Linear":
        w = linear.weight
        module = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            block_size,
            double_quant,
            dtype=w.dtype,
            device=w.device,
        )
        module.load_quantized(quantize_nf4(w, block_size, double_quant))
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach())
        return module

    def parts(self) -> dict[str, torch.Tensor]:
        names = ("codes", "scalers_q", "scaler_factor", "scaler_mean") if self.double_quant else ("codes", "scalers")
        return {name: getattr(self, name) for name in names}

    @torch.no_grad()
    def load_quantized(self, parts: dict[str, torch.Tensor]) -> None:
        for name, buf in self.parts().items():
            buf.copy_(parts[name])

    def dequantize(self, dtype=None) -> torch.Tensor:
        return dequantize_nf4(
            self.parts(), (self.out_features, self.in_features), dtype or self.weight_dtype, self.block_size
        )

    def storage_bits(self) -> int:
        """Bits held for the weight (codes and scalers; the bias is not counted)."""
        return storage_bits(self.parts())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _NF4Matmul.apply(x, self)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"block_size={self.block_size}, double_quant={self.double_quant}"
        )


def is_quantizable(name: str, module: nn.Module) -> bool:
    # The router's few rows decide discrete expert choices; its error would move tokens between
    # experts, and it is too small to matter for memory.
    return isinstance(module, nn.Linear) and name.startswith("layers.") and not name.endswith("router")


def quantize_base(model: nn.Module, block_size: int = 64, double_quant: bool = True) -> nn.Module:
    """Replace every nn.Linear inside the transformer blocks (attention, dense FFN, shared expert) by a
    frozen NF4Linear, in place, and freeze all other parameters. Embeddings, norms and the output head
    keep their dtype, as in QLoRA; routed MoE experts (batched parameters, not nn.Linear) stay as they
    are. Returns the model."""
    targets = [(name, m) for name, m in model.named_modules() if is_quantizable(name, m)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, NF4Linear.from_linear(linear, block_size, double_quant))
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def nf4_bits_per_param(model: nn.Module) -> float:
    """Storage of all NF4 weights in the model, in bits per quantised parameter."""
    layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    if not layers:
        raise ValueError("the model has no NF4Linear layers (call quantize_base first)")
    return sum(m.storage_bits() for m in layers) / sum(m.in_features * m.out_features for m in layers)
