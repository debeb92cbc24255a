"""Whether a tensor sized by a config fits in the memory of the device it would live on.

A size such as ``model.max_seq_len=1_000_000_000`` or ``kiln generate --num-samples 200000`` is a valid
integer whose allocation cannot succeed; the allocator's own failure is a traceback (or, on Linux,
the kernel's OOM killer). Estimating the bytes first turns it into one line naming the key.
"""

from __future__ import annotations

import psutil
import torch

from kiln.errors import ConfigError


def available_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can take now: the host's available memory for the CPU, the
    free memory of a CUDA device; None where that is not known (meta, mps, ...)."""
    if device.type == "cpu":
        return psutil.virtual_memory().available
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return None


def require_memory(key: str, what: str, nbytes: int, device: torch.device) -> None:
    """ConfigError(key) when `what`, estimated at `nbytes`, is more than `device` has available."""
    available = available_bytes(device)
    if available is not None and nbytes > available:
        raise ConfigError(
            key, f"{what} would need {_gib(nbytes)}, more than the {_gib(available)} available on {device}"
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"
