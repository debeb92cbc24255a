"""System metrics for the training log: CPU, RAM, network and disk I/O and (on CUDA) GPU figures
per record.

psutil and torch are imported on first use, so that importing the trainer's helpers stays cheap.
"""

from __future__ import annotations

_process = None  # one psutil.Process, reused: cpu_percent measures since the previous call on it
# The I/O counters and the time of the previous read: rates cover the interval since then.
_last_io: dict = {}


def _io_counters(psutil) -> dict[str, float]:
    """Machine-wide cumulative bytes: network over every interface, disk over every device. A
    counter the platform cannot read (a container without /proc/diskstats) is left out."""
    out = {}
    net = psutil.net_io_counters()
    if net is not None:
        out["net_recv"], out["net_sent"] = float(net.bytes_recv), float(net.bytes_sent)
    try:
        disk = psutil.disk_io_counters()
    except (OSError, RuntimeError):  # psutil raises on some kernels without disk statistics
        disk = None
    if disk is not None:
        out["disk_read"], out["disk_write"] = float(disk.read_bytes), float(disk.write_bytes)
    return out


def prime_system_metrics() -> None:
    """Start every "since the previous call" counter now. The trainer calls this at start-up, so
    the first record's CPU percentages and I/O rates cover the interval up to the first log step
    (unprimed, the first call has no interval: psutil returns 0.0)."""
    import time

    import psutil

    global _process
    _process = psutil.Process()
    psutil.cpu_percent(interval=None)
    _process.cpu_percent(interval=None)
    _last_io.update(time=time.monotonic(), counters=_io_counters(psutil))


def _psutil():
    import psutil

    if _process is None:
        prime_system_metrics()
    return psutil, _process


def _io_rates(psutil) -> dict[str, float]:
    import time

    now, counters = time.monotonic(), _io_counters(psutil)
    before, then = _last_io.get("counters", {}), _last_io.get("time", now)
    _last_io.update(time=now, counters=counters)
    seconds = now - then
    out = {}
    for name, value in counters.items():
        if name in before and seconds > 0:
            # A counter that went backwards wrapped or was reset (an interface went away): no rate.
            out[f"sys/{name}_bytes_per_s"] = max(value - before[name], 0.0) / seconds
    return out


def system_metrics(device=None) -> dict:
    """CPU, RAM and (on CUDA) GPU figures for one metrics record; cheap enough for every log step.

    sys/cpu_percent      whole machine, 0-100, averaged over all cores since the previous call
    sys/proc_cpu_percent this process since the previous call; 100 means one full core, so it can
                         exceed 100 with several threads
    sys/ram_mb           memory in use on the machine (total minus available)
    sys/rss_mb           this process's resident set
    sys/net_recv_bytes_per_s, sys/net_sent_bytes_per_s
                         network bytes per second over all interfaces since the previous call
    sys/disk_read_bytes_per_s, sys/disk_write_bytes_per_s
                         disk bytes per second over all block devices since the previous call
                         (each I/O key is omitted where the platform has no such counter)
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
        **_io_rates(psutil),
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


__all__ = ["prime_system_metrics", "system_metrics"]
