"""Applying a `[peft]` config to a model: freeze the base, add LoRA / QLoRA / adapter weights, and the
helpers that the post-training stages use around them (what trains, parameter counts, running the
frozen base alone)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kiln.errors import ConfigError
from kiln.peft.adapter import AdapterConfig, adapter_modules, apply_adapters
from kiln.peft.config import PeftConfig
from kiln.peft.lora import LoRAConfig, apply_lora, lora_modules
from kiln.peft.nf4 import NF4Linear, quantize_base


def lora_config(cfg: PeftConfig) -> LoRAConfig:
    """The LoRA layer settings of a [peft] table (lora and qlora)."""
    dtype = {
        "auto": torch.bfloat16 if cfg.method == "qlora" else None,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
    }[cfg.lora_dtype]
    return LoRAConfig(
        r=cfg.r, alpha=cfg.alpha, dropout=cfg.dropout, targets=list(cfg.targets), rslora=cfg.rslora, dtype=dtype
    )


def apply_peft(model, cfg: PeftConfig):
    """Apply cfg.method to `model` in place and return it: every base parameter frozen, only the PEFT
    weights trainable. "none" returns the model unchanged (full fine-tuning). For qlora the block
    linears are quantised to NF4 first, then LoRA wraps the targets."""
    cfg.validate()
    if cfg.method == "none":
        return model
    if cfg.method == "adapter":
        return apply_adapters(model, AdapterConfig(hidden=cfg.adapter_hidden))
    if adapter_modules(model):
        # Merging would have to fold a LoRA past an adapter's nonlinearity, and neither output
        # format (PEFT files, merged weights) can hold both.
        raise ConfigError(
            "peft.method",
            f"is {cfg.method!r}, but the model starts from a checkpoint with bottleneck adapters; "
            f'continue it with method = "adapter" (or "none"), or start from a checkpoint without adapters',
        )
    if cfg.method == "qlora":
        quantize_base(model, cfg.nf4_block_size, cfg.double_quant)
    return apply_lora(model, lora_config(cfg))


def trainable_parameters(model) -> list:
    """(name, parameter) of everything that trains; what the optimizer should get."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; NF4 weights count as the parameters they stand for."""
    trainable = sum(p.numel() for _, p in trainable_parameters(model))
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, NF4Linear))
    return trainable, total


@contextmanager
def peft_disabled(model):
    """Run the frozen base alone inside the block (LoRA updates and adapters switched off), e.g. to
    get reference log-probabilities for DPO/PPO without keeping a second copy of the model."""
    modules = [*lora_modules(model).values(), *adapter_modules(model).values()]
    if any(getattr(m, "merged", False) for m in modules):
        raise ValueError("cannot disable merged LoRA layers; unmerge_lora(model) first")
    previous = [m.disabled for m in modules]
    for m in modules:
        m.disabled = True
    try:
        yield model
    finally:
        for m, was in zip(modules, previous):
            m.disabled = was
