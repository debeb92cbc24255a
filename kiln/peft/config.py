"""The `[peft]` section of a post-training recipe (kiln.peft.apply applies it to a model).

Importing this module does not import torch: recipes are parsed by data-only commands too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.errors import ConfigError

METHODS = ("none", "lora", "qlora", "adapter")
LORA_DTYPES = ("auto", "float32", "bfloat16")


def lora_scaling(r: int, alpha: float, rslora: bool = False) -> float:
    """LoRA's output scale: alpha / r, or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023), which
    keeps the update's magnitude stable as the rank grows."""
    return alpha / math.sqrt(r) if rslora else alpha / r


@dataclass
class PeftConfig:
    method: str = "none"  # none | lora | qlora | adapter
    r: int = 8  # LoRA rank
    alpha: float = 16.0  # LoRA scale numerator: s = alpha / r (alpha / sqrt(r) with rslora)
    dropout: float = 0.0  # on the LoRA input
    targets: list[str] = field(default_factory=lambda: ["attn.wqkv", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2"])
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
        if not 0 < self.alpha < math.inf:  # also refuses NaN
            raise ConfigError("alpha", f"must be a positive finite number, got {self.alpha!r}")
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
                f"(e.g. attn.wqkv, attn.wo, ffn.w1, ffn.w3, ffn.w2, output), got {self.targets!r}",
            )
        fused = [t for t in self.targets if t.split(".")[-1] == "w13"]
        if fused:
            raise ConfigError(
                "targets",
                f"{fused[0]!r} no longer exists: SwiGLU's gate and up projections are ffn.w1 and ffn.w3 "
                f"(weights layout 3); name those instead",
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
        return lora_scaling(self.r, self.alpha, self.rslora)
