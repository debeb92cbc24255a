"""Process-level helpers shared by every stage: system metrics for the training log, and the
progress bars of the long-running verbs.

Heavy imports (psutil, torch) happen on first use, so data and tokenizer stages can import the
progress helpers without importing torch.
"""

from __future__ import annotations

import os
import sys

# Set KILN_PROGRESS=1 to force bars on (e.g. in a log file), 0 to force them off.
PROGRESS_ENV = "KILN_PROGRESS"

_process = None  # one psutil.Process, reused: cpu_percent measures since the previous call on it


def _psutil():
    import psutil

    global _process
    if _process is None:
        _process = psutil.Process()
        # Both counters report "since the last call"; the very first call has no interval and
        # returns 0.0, so prime them here and the first logged value covers a real interval.
        psutil.cpu_percent(interval=None)
        _process.cpu_percent(interval=None)
    return psutil, _process


def system_metrics(device=None) -> dict:
    """CPU, RAM and (on CUDA) GPU figures for one metrics record; cheap enough for every log step.

    sys/cpu_percent      whole machine, 0-100, averaged over all cores since the previous call
    sys/proc_cpu_percent this process since the previous call; 100 means one full core, so it can
                         exceed 100 with several threads
    sys/ram_mb           memory in use on the machine (total minus available)
    sys/rss_mb           this process's resident set
    sys/gpu_util         percent of the last sample period the GPU was busy (needs NVML: the
                         nvidia-ml-py package); omitted when NVML cannot be read
    sys/gpu_mem_mb       memory held by live tensors on the device (torch.cuda.memory_allocated)
    sys/gpu_mem_used_mb  memory in use on the whole device, as nvidia-smi shows it (includes the
                         caching allocator's reserve and other processes)
    """
    psutil, process = _psutil()
    memory = psutil.virtual_memory()
    out = {
        "sys/cpu_percent": float(psutil.cpu_percent(interval=None)),
        # Clamped: over a very short interval the 10 ms granularity of CPU times can exceed what
        # the cores could have done.
        "sys/proc_cpu_percent": min(float(process.cpu_percent(interval=None)), 100.0 * (psutil.cpu_count() or 1)),
        "sys/ram_mb": (memory.total - memory.available) / 2**20,
        "sys/rss_mb": process.memory_info().rss / 2**20,
    }
    if device is not None and str(device).startswith("cuda"):
        out.update(_cuda_metrics(device))
    return out


def _cuda_metrics(device) -> dict:
    import torch

    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out = {"sys/gpu_mem_mb": torch.cuda.memory_allocated(device) / 2**20}
    free, total = torch.cuda.mem_get_info(device)
    out["sys/gpu_mem_used_mb"] = (total - free) / 2**20
    try:
        out["sys/gpu_util"] = float(torch.cuda.utilization(device))
    except Exception:  # noqa: BLE001 - no NVML library or binding: leave the key out, never fail a step
        pass
    return out


def is_rank_zero() -> bool:
    """True unless a launcher (torchrun, Slurm via torchrun) says this is another rank."""
    return os.environ.get("RANK", "0") == "0"


def progress_enabled() -> bool | None:
    """Whether to draw progress bars: never off rank 0; KILN_PROGRESS=1/0 forces on/off; otherwise
    None, which tqdm reads as "only when stderr is a terminal", so log files stay clean."""
    if not is_rank_zero():
        return False
    forced = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    return None


def progress_visible() -> bool:
    """progress_enabled() resolved to a yes or no (for code that must decide before drawing)."""
    enabled = progress_enabled()
    if enabled is None:
        return sys.stderr.isatty()
    return enabled


def progress(iterable=None, *, total=None, desc: str | None = None, unit: str = "it", **kwargs):
    """A tqdm bar on stderr with rate and ETA, following progress_enabled()."""
    from tqdm import tqdm

    enabled = progress_enabled()
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        dynamic_ncols=True,
        disable=None if enabled is None else not enabled,
        **kwargs,
    )


__all__ = ["system_metrics", "is_rank_zero", "progress_enabled", "progress_visible", "progress", "PROGRESS_ENV"]
