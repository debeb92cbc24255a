"""Training precision: the dtype of each `precision` setting and the autocast the training loop runs
its forward passes under. Anything that must compute what the loop computes (DPO's reference
log-probs, PPO's rollout log-probs) uses the same `autocast`, so the numbers agree bit for bit."""

from __future__ import annotations

from contextlib import nullcontext

import torch

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device | str = "cpu"):
    """The training loop's autocast for `precision` on `device` (fp32: no autocast at all)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=PRECISION_DTYPES[precision])
