"""LoRA (Hu et al. 2021): a frozen linear layer plus a trainable low-rank update,
y = W x + s * B (A dropout(x)), with A [r, in] and B [out, r].

Conventions follow Hugging Face PEFT so that adapters move between the two (kiln/peft/peft_io.py):
A starts like nn.Linear's default (Kaiming uniform, a = sqrt(5)) and B at zero, so the wrapped model
starts exactly equal to the base; s = alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023),
which keeps the update's scale from shrinking as the rank grows.

Targets are names of Kiln modules, matched on whole dotted components at the end of the module path:
"wqkv" and "attn.wqkv" both select every layers.<i>.attn.wqkv. Kiln's q/k/v projections are fused
(`attn.wqkv`), so one LoRA covers all three; its B splits by rows into the separate projections' LoRAs,
all sharing A (see peft_io). SwiGLU's gate and up are the separate `ffn.w1` and `ffn.w3`.

The base layer is kept as a `base` submodule, an nn.Linear or an NF4Linear (QLoRA). Merging adds
s * B @ A into an nn.Linear base in float32; a 4-bit base cannot absorb it without re-quantising (lossy,
as PEFT warns), so merge_lora refuses and peft_io.merged_state_dict produces full-precision weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.peft.config import lora_scaling
from kiln.peft.nf4 import NF4Linear

KILN_LINEAR_NAMES = ("attn.wqkv", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2", "output")


@dataclass
class LoRAConfig:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["wqkv", "wo", "w1", "w3", "w2"])
    rslora: bool = False
    dtype: torch.dtype | None = None  # of A and B; None: the base weight's dtype

    @property
    def scaling(self) -> float:
        return lora_scaling(self.r, self.alpha, self.rslora)


def _base_dtype_device(base: nn.Module):
    if isinstance(base, NF4Linear):
        return base.weight_dtype, base.codes.device
    return base.weight.dtype, base.weight.device


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, r: int, scaling: float, dropout: float = 0.0, dtype=None):
        super().__init__()
        if not isinstance(base, (nn.Linear, NF4Linear)):
            raise TypeError(f"LoRA wraps nn.Linear or NF4Linear, got {type(base).__name__}")
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        base_dtype, device = _base_dtype_device(base)
        dtype = dtype or base_dtype
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, r, dtype=dtype, device=device))
        self.scaling = float(scaling)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.disabled = False  # the base alone, e.g. to score with the reference model in DPO
        self.reset_lora_parameters()
        self.train(base.training)  # a model already in eval mode must not start dropping out

    @property
    def r(self) -> int:
        return self.lora_A.shape[0]

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def delta_weight(self) -> torch.Tensor:
        """s * B @ A in float32, [out, in]."""
        return (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.merged or self.disabled:
            return out
        h = self.dropout(x)
        if not torch.is_autocast_enabled(x.device.type):
            h = h.to(self.lora_A.dtype)  # e.g. bf16 LoRA on a float32 activation stream (QLoRA)
        delta = F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling
        return out + delta.to(out.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        if self.merged:
            return
        if not isinstance(self.base, nn.Linear):
            raise ValueError(
                "cannot merge LoRA into a 4-bit NF4 base without re-quantising it (lossy); "
                "use kiln.peft.merged_state_dict(model) for full-precision merged weights"
            )
        w = self.base.weight
        w.copy_((w.float() + self.delta_weight()).to(w.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        w = self.base.weight
        w.copy_((w.float() - self.delta_weight()).to(w.dtype))
        self.merged = False

    def extra_repr(self) -> str:
        return f"r={self.r}, scaling={self.scaling:g}, merged={self.merged}"


def matches_target(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Freeze every parameter and wrap each nn.Linear / NF4Linear whose name ends with a target, in
    place. Each target must match at least one layer. Returns the model."""
    if cfg.r < 1:
        raise ConfigError("r", f"must be >= 1, got {cfg.r}")
    if lora_modules(model):
        raise ValueError("the model already has LoRA layers")
    for p in model.parameters():
        p.requires_grad_(False)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, NF4Linear))]
    for target in cfg.targets:
        if not any(matches_target(n, target) for n, _ in linears):
            hint = " (tied embeddings have no separate output layer)" if target == "output" else ""
            raise ConfigError(
                "targets", f"{target!r} matches no linear layer{hint}; Kiln's are {', '.join(KILN_LINEAR_NAMES)}"
            )
    for name, module in linears:
        if any(matches_target(name, t) for t in cfg.targets):
            _set_submodule(model, name, LoRALinear(module, cfg.r, cfg.scaling, cfg.dropout, cfg.dtype))
    return model


def set_lora(
    model: nn.Module,
    name: str,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    dtype=None,
) -> LoRALinear:
    """Give the layer `name` exactly this LoRA (any rank), wrapping it if it has none yet."""
    module = model.get_submodule(name)
    base = module.base if isinstance(module, LoRALinear) else module
    if isinstance(module, LoRALinear) and module.merged:
        raise ValueError(f"{name}: unmerge the LoRA before replacing it")
    fits = (lora_B.shape[0], lora_A.shape[1]) == (base.out_features, base.in_features)
    if lora_B.shape[1] != lora_A.shape[0] or not fits:
        raise ValueError(
            f"{name}: LoRA shapes A {tuple(lora_A.shape)}, B {tuple(lora_B.shape)} do not fit a "
            f"{base.in_features} -> {base.out_features} layer"
        )
    lora = LoRALinear(base, lora_A.shape[0], scaling, dropout, dtype or lora_A.dtype)
    with torch.no_grad():
        lora.lora_A.copy_(lora_A)
        lora.lora_B.copy_(lora_B)
    _set_submodule(model, name, lora)
    return lora


def merge_lora(model: nn.Module) -> nn.Module:
    for m in lora_modules(model).values():
        m.merge()
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    for m in lora_modules(model).values():
        m.unmerge()
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the LoRA matrices: {"<layer>.lora_A": ..., "<layer>.lora_B": ...}."""
    out = {}
    for name, m in lora_modules(model).items():
        out[f"{name}.lora_A"] = m.lora_A.detach()
        out[f"{name}.lora_B"] = m.lora_B.detach()
    return out


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy LoRA matrices into an already wrapped model; keys and shapes must match exactly."""
    own = lora_modules(model)
    expected = {f"{n}.lora_{x}" for n in own for x in "AB"}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"LoRA state does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if any(m.merged for m in own.values()):
        raise ValueError("unmerge the LoRA layers (unmerge_lora) before loading new LoRA weights")
    with torch.no_grad():
        for name, m in own.items():
            for part in ("lora_A", "lora_B"):
                src, dst = state[f"{name}.{part}"], getattr(m, part)
                if src.shape != dst.shape:
                    raise ValueError(f"{name}.{part}: shape {tuple(src.shape)} != model's {tuple(dst.shape)}")
                dst.copy_(src)
