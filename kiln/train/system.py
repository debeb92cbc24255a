"""System metrics for the training log: CPU, RAM and (on CUDA) GPU figures per record.

psutil and torch are imported on first use, so that importing the trainer's helpers stays cheap.
"""

from __future__ import annotations

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


__all__ = ["system_metrics"]
