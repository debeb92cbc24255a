"""Bottleneck adapters (Houlsby et al. 2019): a small residual MLP after each attention and FFN
sublayer, h -> h + up(gelu(down(h))), with everything else frozen.

`up` starts at zero, so a freshly adapted model computes exactly what the base did and training starts
from the pretrained function. The adapter sits on the sublayer's output before the block adds it to the
residual stream, as in the Houlsby layout (two adapters per block).

Adapters are attached with forward hooks on `attn` and `ffn` instead of by replacing those modules, so
the blocks keep their types and attributes (context parallelism swaps `attn.attention`; MoE layers keep
their own `ffn`), and the adapter weights live at `layers.<i>.attn.adapter.*` / `layers.<i>.ffn.adapter.*`.
They cannot be folded into the base weights (the nonlinearity sits between them), so an adapted model
exports only as base + adapter, not as a plain checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import ConfigError


@dataclass
class AdapterConfig:
    hidden: int = 64  # bottleneck width


class BottleneckAdapter(nn.Module):
    def __init__(self, dim: int, hidden: int, dtype=None, device=None):
        super().__init__()
        self.down = nn.Linear(dim, hidden, dtype=dtype, device=device)
        self.up = nn.Linear(hidden, dim, dtype=dtype, device=device)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)
        self.disabled = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(F.gelu(self.down(h), approximate="tanh"))


def _adapter_hook(module: nn.Module, args, output):
    adapter = module.adapter
    return output if adapter.disabled else adapter(output)


def adapter_modules(model: nn.Module) -> dict[str, BottleneckAdapter]:
    return {name: m for name, m in model.named_modules() if isinstance(m, BottleneckAdapter)}


def apply_adapters(model: nn.Module, cfg: AdapterConfig) -> nn.Module:
    """Freeze every parameter and add an adapter after the attention and the FFN of every block."""
    if cfg.hidden < 1:
        raise ConfigError("adapter_hidden", f"must be >= 1, got {cfg.hidden}")
    existing = adapter_modules(model)
    if existing:
        return _continue_adapters(model, existing, cfg)
    layers = getattr(model, "layers", None)
    if layers is None:
        raise TypeError(f"adapters need a Kiln Transformer (with .layers), got {type(model).__name__}")
    for p in model.parameters():
        p.requires_grad_(False)
    dim = model.cfg.dim
    for block in layers:
        ref = block.attn_norm.weight  # a float parameter every block has: the adapter's dtype and device
        for sub in (block.attn, block.ffn):
            sub.adapter = BottleneckAdapter(dim, cfg.hidden, dtype=ref.dtype, device=ref.device).train(sub.training)
            sub.register_forward_hook(_adapter_hook)
    return model


def _continue_adapters(model: nn.Module, existing: dict, cfg: AdapterConfig) -> nn.Module:
    """A model that already has adapters (loaded from the checkpoint a stage starts from) trains
    those: a stage after an adapter stage continues from its adapters rather than stacking new ones."""
    widths = {m.down.out_features for m in existing.values()}
    if widths != {cfg.hidden}:
        raise ConfigError(
            "peft.adapter_hidden",
            f"is {cfg.hidden}, but the model already has adapters of width {sorted(widths)[0]} "
            f"(from the checkpoint it starts from); set it to that width to continue training them",
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for m in existing.values():
        for p in m.parameters():
            p.requires_grad_(True)
    return model


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": t.detach() for name, m in adapter_modules(model).items() for k, t in m.state_dict().items()}


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    expected = adapter_state_dict(model)
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"adapter state does not fit the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for key, dst in expected.items():
            if state[key].shape != dst.shape:
                raise ValueError(f"{key}: shape {tuple(state[key].shape)} != model's {tuple(dst.shape)}")
            dst.copy_(state[key])
