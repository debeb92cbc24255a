"""The `[peft]` section of a post-training recipe, and the one call that applies it to a model.

Importing this module does not import torch (recipes are parsed by data-only commands too); torch and
the PEFT modules load when apply_peft runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from kiln.errors import ConfigError

METHODS = ("none", "lora", "qlora", "adapter")
LORA_DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class PeftConfig:
    method: str = "none"  # none | lora | qlora | adapter
    r: int = 8  # LoRA rank
    alpha: float = 16.0  # LoRA scale numerator: s = alpha / r (alpha / sqrt(r) with rslora)
    dropout: float = 0.0  # on the LoRA input
    targets: list[str] = field(default_factory=lambda: ["attn.wqkv", "attn.wo", "ffn.w13", "ffn.w2"])
    rslora: bool = False
    # LoRA weights' dtype. auto: the base weight's dtype for lora, bfloat16 for qlora (as in QLoRA).
    lora_dtype: str = "auto"
    adapter_hidden: int = 64  # bottleneck width of method = "adapter"
    nf4_block_size: int = 64  # values per absmax scaler (qlora)
    double_quant: bool = True  # quantise the scalers too: 4.127 instead of 4.5 bits per parameter

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError("method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError("r", f"must be an integer >= 1, got {self.r!r}")
        if not self.alpha > 0:
            raise ConfigError("alpha", f"must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        if (
            not isinstance(self.targets, (list, tuple))
            or not self.targets
            or not all(isinstance(t, str) and t for t in self.targets)
        ):
            raise ConfigError(
                "targets",
                f"must be a non-empty list of module names "
                f"(e.g. attn.wqkv, attn.wo, ffn.w13, ffn.w2, output), got {self.targets!r}",
            )
        if self.lora_dtype not in LORA_DTYPES:
            raise ConfigError("lora_dtype", f"must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if isinstance(self.adapter_hidden, bool) or not isinstance(self.adapter_hidden, int) or self.adapter_hidden < 1:
            raise ConfigError("adapter_hidden", f"must be an integer >= 1, got {self.adapter_hidden!r}")
        if (
            isinstance(self.nf4_block_size, bool)
            or not isinstance(self.nf4_block_size, int)
            or self.nf4_block_size < 2
            or self.nf4_block_size % 2
        ):
            # Two 4-bit codes share a byte, so a block must hold an even number of values.
            raise ConfigError("nf4_block_size", f"must be a positive even integer, got {self.nf4_block_size!r}")

    @property
    def scaling(self) -> float:
        from kiln.peft.lora import lora_scaling

        return lora_scaling(self.r, self.alpha, self.rslora)

    def lora_config(self):
        import torch

        from kiln.peft.lora import LoRAConfig

        dtype = {
            "auto": torch.bfloat16 if self.method == "qlora" else None,
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
        }[self.lora_dtype]
        return LoRAConfig(
            r=self.r,
            alpha=self.alpha,
            dropout=self.dropout,
            targets=list(self.targets),
            rslora=self.rslora,
            dtype=dtype,
        )


def apply_peft(model, cfg: PeftConfig):
    """Apply cfg.method to `model` in place and return it: every base parameter frozen, only the PEFT
    weights trainable. "none" returns the model unchanged (full fine-tuning). For qlora the block
    linears are quantised to NF4 first, then LoRA wraps the targets."""
    cfg.validate()
    if cfg.method == "none":
        return model
    if cfg.method == "adapter":
        from kiln.peft.adapter import AdapterConfig, apply_adapters

        return apply_adapters(model, AdapterConfig(hidden=cfg.adapter_hidden))
    from kiln.peft.lora import apply_lora

    if cfg.method == "qlora":
        from kiln.peft.nf4 import quantize_base

        quantize_base(model, cfg.nf4_block_size, cfg.double_quant)
    return apply_lora(model, cfg.lora_config())


def trainable_parameters(model) -> list:
    """(name, parameter) of everything that trains; what the optimizer should get."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def parameter_counts(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; NF4 weights count as the parameters they stand for."""
    from kiln.peft.nf4 import NF4Linear

    trainable = sum(p.numel() for _, p in trainable_parameters(model))
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, NF4Linear))
    return trainable, total


@contextmanager
def peft_disabled(model):
    """Run the frozen base alone inside the block (LoRA updates and adapters switched off), e.g. to
    get reference log-probabilities for DPO/PPO without keeping a second copy of the model."""
    from kiln.peft.adapter import adapter_modules
    from kiln.peft.lora import lora_modules

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
