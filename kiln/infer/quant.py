"""Weight-only quantisation of a Kiln Transformer for inference: int8 per output channel, int4 in
groups along the input dimension, or NF4 (kiln.peft.nf4, the QLoRA format).

Only weights are quantised; activations, the KV cache, norms and embeddings keep the model's dtype.
Every projection inside the blocks (fused q/k/v, output, fused gate/up, down; a shared MoE expert) and,
unless told otherwise, the output head is replaced by a module that stores integer codes plus scales
and computes x @ dequant(W)^T:

- int8: w ~ q * s with q in [-128, 127] and one scale s = absmax / 127.5 per output row (symmetric, so
  the 0 of the weight is exact). Storage: 8 bits per weight plus one scale per row.
- int4: each group of `group_size` consecutive inputs of a row gets an affine map
  w ~ (q - 8) * s + z with q in [0, 15], s = (max - min) / 15 and z = min + 8 s (the min/max scheme of
  gpt-fast and torchao's int4 weight-only layout), so the group's min and max are both representable.
  For float32 weights both schemes give torchao's codes and scales bit for bit (torchao's
  SYMMETRIC int8 and its tinygemm int4 qparams; tests/infer/test_quant.py checks it).
  Storage: 4 bits per weight plus a scale and a zero per group.
- nf4: kiln.peft.nf4.NF4Linear (16 normal-quantile levels per block of `group_size`, double-quantised
  absmax scalers), dequantised in every forward.

Speed on CPU: PyTorch ships fused kernels that read the int8 or packed int4 codes directly
(torch._weight_int8pack_mm, torch._weight_int4pack_mm_for_cpu). With bfloat16 activations they run at
or above the speed of a bf16 matmul and move 2-4x fewer weight bytes; with float32 activations (torch
2.13) they fall back to reference loops, usually several times slower than dequantising the weight and
calling a float32 matmul (docs/benchmarks.md). So the kernels are used for bfloat16 activations on CPU; any other dtype or
device dequantises the weight in every forward (exact, but slower than the unquantised model).
Quantise a bf16 model (model.to(torch.bfloat16)) for speed. The int8 kernel gives wrong results when
the input width is not a multiple of 16 and the int4 one needs whole groups of 32-256 values, so
those layers (only tiny test models have them) dequantise as well.

The int4 codes are stored in the layout torch's CPU kernel reads (tests/infer/test_quant.py checks it
against torch._convert_weight_to_int4pack_for_cpu): for each block of 64 output rows, byte [k, n] holds
row n's code for input k in its low nibble and row n + 32's in its high nibble. Rows are padded to a
multiple of 64 (padded rows have zero scale and zero, and their outputs are cut off).
"""

from __future__ import annotations

import functools
import itertools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.peft.nf4 import NF4Linear, is_quantizable

SCHEMES = ("int8", "int4", "nf4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUP_SIZE = {"int4": 64, "nf4": 64}
_ROW_BLOCK = 64  # output rows per block of the CPU int4 layout


def _scale_dtype(weight: torch.Tensor) -> torch.dtype:
    # Scales are kept in the dtype the model computes in: the kernels need them there, and a float32
    # copy of them next to bf16 ones would cost a further bit per int4 weight.
    return weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.float32


def _store(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 scale, floored at the smallest normal number (an all-zero row or a constant group has
    range 0; any positive scale reproduces it), in the dtype it is kept in."""
    scale = scale.clamp(min=torch.finfo(torch.float32).smallest_normal).to(dtype)
    return scale.clamp(min=torch.finfo(dtype).smallest_normal)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _uses_kernel(x: torch.Tensor, dtype: torch.dtype) -> bool:
    return x.device.type == "cpu" and dtype == torch.bfloat16


class _QuantLinear(nn.Module):
    """Shared by the int8 and int4 modules: the bias, the fallback and the reshaping around kernels."""

    def _init_bias(self, linear: nn.Linear) -> None:
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        x = x.to(dtype)
        if self.kernel_ok and _uses_kernel(x, dtype):
            y = self._kernel(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        else:
            y = F.linear(x, self.dequantize(dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _scales_in(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == dtype else tensor.to(dtype)

    def storage_bits(self) -> int:
        """Bits held for the weight (codes and scales; the bias is not counted)."""
        return 8 * sum(b.numel() * b.element_size() for name, b in self.named_buffers() if name != "bias")


class Int8Linear(_QuantLinear):
    """y = x @ (q * s)^T + b with int8 codes q [out, in] and one scale per output row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self._init_bias(linear)
        w = linear.weight.detach().float()
        scales = _store(w.abs().amax(dim=1) / 127.5, _scale_dtype(linear.weight))
        # Rounding against the stored (possibly bf16) scale picks the nearest level the forward uses.
        q = (w * (1.0 / scales.float()[:, None])).round().clamp(-128, 127).to(torch.int8)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.kernel_ok = self.in_features % 16 == 0

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x2d, self.qweight, self._scales_in(self.scales, x2d.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 with N a multiple of 64 -> uint8 [N, K/2] in the CPU kernel's layout."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).view(n // _ROW_BLOCK, 2, _ROW_BLOCK // 2, k)
    packed = blocks[:, 0] | (blocks[:, 1] << 4)  # [N/64, 32, K]: rows n and n + 32 share a byte
    return packed.transpose(1, 2).contiguous().view(n, k // 2)


@functools.lru_cache(maxsize=None)
def int4_layout_is_native() -> bool:
    """Whether pack_int4's layout is the one torch's CPU int4 kernel reads on this CPU."""
    probe = torch.arange(_ROW_BLOCK * 64, dtype=torch.int32).remainder(16).view(_ROW_BLOCK, 64)
    try:
        native = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
    except RuntimeError:
        return False
    return native.shape == (_ROW_BLOCK, 32) and torch.equal(native, pack_int4(probe))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [N, K/2] -> codes [N, K] (uint8)."""
    n, half = packed.shape
    k = 2 * half
    blocks = packed.view(n // _ROW_BLOCK, k, _ROW_BLOCK // 2)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=1)  # [N/64, 2, K, 32]
    return codes.transpose(2, 3).reshape(n, k)


class Int4Linear(_QuantLinear):
    """y = x @ W^T + b with W[n, g*G + j] = (q - 8) * s[g, n] + z[g, n]: 4-bit codes q, and a scale s
    and zero z per group of G = group_size inputs of each row (scales_and_zeros [K/G, N_padded, 2],
    the kernel's layout)."""

    def __init__(self, linear: nn.Linear, group_size: int):
        super().__init__()
        self._init_bias(linear)
        n, k, g = self.out_features, self.in_features, group_size
        self.group_size = g
        w = linear.weight.detach().float().view(n, k // g, g)
        dtype = _scale_dtype(linear.weight)
        low, high = w.amin(dim=2), w.amax(dim=2)
        scale = _store((high - low) / 15, dtype)
        zero = (low + scale.float() * 8).to(dtype)
        s, z = scale.float()[..., None], zero.float()[..., None]
        codes = ((w - (z - s * 8)) / s).round().clamp(0, 15)
        padded = -(-n // _ROW_BLOCK) * _ROW_BLOCK
        codes = F.pad(codes.view(n, k), (0, 0, 0, padded - n))
        # Padded rows: scale and zero 0, so the kernel computes zeros there whatever their codes.
        scales_and_zeros = F.pad(torch.stack([scale, zero], dim=-1), (0, 0, 0, 0, 0, padded - n))
        self.register_buffer("qweight", pack_int4(codes))
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous())
        # The kernel's weight layout depends on the CPU (an AVX2-only CPU packs differently from an
        # AVX-512 one): where pack_int4's layout is not this CPU's, the exact dequantised path runs.
        self.kernel_ok = int4_layout_is_native()

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group_size
        codes = unpack_int4(self.qweight)[:n].float().view(n, k // g, g)
        sz = self.scales_and_zeros[:, :n].float()  # [K/G, N, 2]
        scale, zero = sz[..., 0].T[..., None], sz[..., 1].T[..., None]
        return ((codes - 8) * scale + zero).view(n, k).to(dtype)

    def _kernel(self, x2d: torch.Tensor) -> torch.Tensor:
        sz = self._scales_in(self.scales_and_zeros, x2d.dtype)
        y = torch._weight_int4pack_mm_for_cpu(x2d, self.qweight, self.group_size, sz)
        return y if y.shape[1] == self.out_features else y[:, : self.out_features]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"group_size={self.group_size}"
        )


QUANTIZED_TYPES = (Int8Linear, Int4Linear, NF4Linear)


def _targets(model: nn.Module, include_output: bool) -> list[tuple[str, nn.Linear]]:
    targets = [(name, m) for name, m in model.named_modules() if is_quantizable(name, m)]
    output = getattr(model, "output", None)
    if include_output and isinstance(output, nn.Linear):
        # A tied head (output is None) reuses the embedding matrix, which stays in full precision.
        targets.append(("output", output))
    return targets


def _check_group_size(scheme: str, group_size: int | None) -> int | None:
    if scheme == "int8":
        if group_size is not None:
            raise ConfigError(
                "group_size", f"int8 uses one scale per output channel; leave group_size unset, got {group_size}"
            )
        return None
    group_size = DEFAULT_GROUP_SIZE[scheme] if group_size is None else group_size
    if scheme == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ConfigError("group_size", f"int4 needs one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size}")
    if scheme == "nf4" and (group_size <= 0 or group_size % 2):
        raise ConfigError("group_size", f"nf4 needs a positive even block size, got {group_size}")
    return group_size


@torch.no_grad()
def quantize_model(
    model: nn.Module, scheme: str = "int8", group_size: int | None = None, include_output: bool = True
) -> nn.Module:
    """Replace the Transformer's linear layers by weight-only quantised ones, in place; returns the
    model. scheme: "int8" (per output channel; no group_size), "int4" (group_size 32, 64 (default),
    128 or 256 inputs per scale) or "nf4" (kiln.peft.nf4, block size group_size, default 64).
    include_output: also quantise the output head (the largest single matrix for small models; an
    untied head only). Embeddings, norms, the MoE router and routed experts stay as they are."""
    if scheme not in SCHEMES:
        raise ConfigError("scheme", f"must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    group_size = _check_group_size(scheme, group_size)
    targets = _targets(model, include_output)
    if scheme == "int4":
        for name, linear in targets:
            if linear.in_features % group_size:
                raise ConfigError(
                    "group_size", f"{name} has {linear.in_features} inputs, not a multiple of group_size {group_size}"
                )
    for name, linear in targets:
        if scheme == "int8":
            new = Int8Linear(linear)
        elif scheme == "int4":
            new = Int4Linear(linear, group_size)
        else:
            new = NF4Linear.from_linear(linear, block_size=group_size)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def quantized_bits_per_param(model: nn.Module) -> float:
    """Storage of the quantised weights (codes, scales, zeros) per weight they stand for."""
    layers = [m for m in model.modules() if isinstance(m, QUANTIZED_TYPES)]
    if not layers:
        raise ValueError("the model has no quantised layers (call quantize_model first)")
    return sum(m.storage_bits() for m in layers) / sum(m.in_features * m.out_features for m in layers)


def model_bytes(model: nn.Module) -> int:
    """Bytes of everything a checkpoint of the model holds: parameters and persistent buffers."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


# PackedLinear layers by key, for the compiled decode step: its packed weight is an opaque oneDNN
# tensor that torch.compile cannot trace or lower, so under compile the layer calls packed_linear
# with its key and the op reads the weight here. Weak: a dropped model frees its layers.
_PACKED_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_PACKED_KEYS = itertools.count()


@torch.library.custom_op("kiln::packed_linear", mutates_args=(), schema="(Tensor x, int key) -> Tensor")
def packed_linear(x, key):
    return _PACKED_LAYERS[key].linear(x)


@packed_linear.register_fake
def _packed_linear_shape(x, key):
    layer = _PACKED_LAYERS[key]
    return x.new_empty(*x.shape[:-1], layer.out_features, dtype=layer.dtype)


def frozen_trace() -> bool:
    """Whether a trace now turns module weights into graph constants (inductor's freezing, which
    dynamo applies only with gradients off). The same test as torch._dynamo.utils.is_parameter_freezing,
    which dynamo refuses to trace (a graph break inside the compiled step), so it is written out here."""
    return bool(torch._inductor.config.freezing) and not torch.is_grad_enabled()


PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


def _refuse_unpackable(weights: list[torch.Tensor]) -> None:
    """One named error for every weight oneDNN cannot pack, raised before anything is replaced."""
    refused = sorted(
        {f"{w.dtype} on {w.device}" for w in weights if w.dtype not in PACKABLE_DTYPES or w.device.type != "cpu"}
    )
    if refused:
        raise ConfigError("dtype", f"prepacking needs a bfloat16 or float32 model on the CPU, got {', '.join(refused)}")


class PackedLinear(nn.Module):
    """A bf16 or fp32 nn.Linear whose weight is reordered once into oneDNN's blocked layout. CPU only,
    and the packed tensor is opaque: it cannot be saved, copied or moved, so pack as the last step.

    bf16: F.linear on a plain bf16 weight lets oneDNN reorder it on every call, which at decode batch
    sizes costs as much as the matmul itself; the prepacked weight skips that, bit-identical.
    fp32: torch's own fp32 matmul of a few rows (the server's steps of 2-32 streams) runs far below the
    CPU's peak; oneDNN's packed kernel was 1.5-2.8x faster at 2-32 rows and 1.3-1.5x at one row on
    Zen 4 (docs/benchmarks.md), within ~1e-6 relative of F.linear but not bit-identical."""

    def __init__(self, linear: nn.Linear, batch_hint: int | None = None):
        super().__init__()
        weight = linear.weight.detach()
        _refuse_unpackable([weight])
        self.in_features, self.out_features, self.dtype = linear.in_features, linear.out_features, weight.dtype
        if batch_hint is None:
            # oneDNN lays the weight out for this many rows. fp32 laid out for one row ran 2-16 rows no
            # faster than F.linear; laid out for 4 or more it was 1.5-2.8x faster at 2-32 rows and 1.3x
            # at one (Zen 4, docs/benchmarks.md). For bf16 the hint made no measurable difference.
            batch_hint = 8 if weight.dtype == torch.float32 else 1
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.key = next(_PACKED_KEYS)
        _PACKED_LAYERS[self.key] = self

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and not frozen_trace():
            # The opaque weight cannot be a graph input of oneDNN's op in inductor, so the layer is one
            # custom op that reads it from _PACKED_LAYERS: a call back into Python per layer and step.
            return packed_linear(x, self.key)
        # Eager, or traced under freezing (CompiledDecoder on a prepacked model): there the packed
        # weight becomes a graph constant and inductor calls oneDNN from its C++ wrapper directly.
        return self.linear(x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"dtype={self.dtype}"
        )


def onednn_packs_bf16() -> bool:
    """Whether oneDNN can pack bf16 weights here (AVX512-BW/VL/DQ or AVX-NE-CONVERT; not AVX2 alone)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


@torch.no_grad()
def prepack_model(model: nn.Module, include_output: bool = True, batch_hint: int | None = None) -> nn.Module:
    """Replace the bf16 or fp32 linears that quantize_model would touch by PackedLinear, in place."""
    if not torch.backends.mkldnn.is_available():
        raise ConfigError("prepack", "this torch build has no oneDNN (mkldnn); prepacking is unavailable")
    targets = _targets(model, include_output)
    weights = [linear.weight for _, linear in targets]
    _refuse_unpackable(weights)  # before any layer is replaced, so a refused model is left whole
    if any(w.dtype == torch.bfloat16 for w in weights) and not onednn_packs_bf16():
        # oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT; on AVX2 it raises a raw RuntimeError.
        raise ConfigError(
            "prepack", "this CPU has no oneDNN bf16 kernels (AVX2 only); run without prepacking or in float32"
        )
    for name, linear in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, PackedLinear(linear, batch_hint))
    return model
