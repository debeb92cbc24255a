"""Metrics: a JSONL log (optionally mirrored to TensorBoard), peak-FLOPs detection, MFU, peak memory."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

# Dense (non-sparse) bf16 tensor-core peaks from the vendors' data sheets, FLOP/s per device.
# Matched by substring of torch.cuda.get_device_name(), most specific first.
CUDA_BF16_PEAKS = [
    ("GB200", 2.5e15), ("B200", 2.25e15), ("B100", 1.75e15),
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12),
    ("A100", 312e12), ("A800", 312e12), ("A10G", 70e12), ("A6000", 155e12), ("L40S", 362e12),
    ("L40", 181e12), ("L4", 121e12), ("4090", 165e12), ("3090", 71e12), ("V100", 125e12), ("T4", 65e12),
    ("MI300X", 1.307e15), ("MI250X", 383e12),
]


class MetricsLogger:
    """Appends one JSON object per record to `<out_dir>/metrics.jsonl`, flushed immediately
    so a crashed run keeps everything logged before the crash."""

    def __init__(self, out_dir, tensorboard: bool = False):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:  # imported lazily: tensorboard is an optional dependency
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))
            except ImportError:
                warnings.warn("tensorboard logging requested but the tensorboard package is not installed; "
                              "logging to metrics.jsonl only", stacklevel=2)

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            prefix = record.get("kind", "train")
            for key, value in record.items():
                if key not in ("step", "kind") and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{prefix}/{key}", value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def truncate_metrics(path, last_step: int) -> None:
    """Drop records after `last_step` (and any line cut short by a crash), so a resumed run's
    log reads like the log of an uninterrupted run."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= last_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def measure_cpu_peak_flops(dtype: torch.dtype, seconds: float = 0.3, n: int = 1024) -> float:
    """Best FLOP/s of a square matmul in this process, as the CPU's practical peak.

    Measured rather than taken from a table because a CPU's usable peak depends on its vector
    units (AVX-512, AMX), its thread count and host contention (VMs vary ~2x). The best of
    repeated short runs estimates the uncontended peak.
    """
    # A private generator: measuring must not advance the global RNG that seeds the model.
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    torch.matmul(a, b)  # warm-up: oneDNN picks and JITs its kernel on the first call
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(a, b)
        elapsed = time.perf_counter() - start
        best = max(best, 2 * n**3 / elapsed)
    return best


def detect_peak_flops(device: torch.device, dtype: torch.dtype, override: float = 0.0) -> float:
    """Peak FLOP/s of one device for `dtype` compute; `override` (> 0) wins."""
    if override > 0:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in CUDA_BF16_PEAKS:
            if key in name:
                # fp32 without TF32 runs on CUDA cores at a small fraction of the tensor-core peak;
                # fp16 tensor-core peaks equal bf16 on these parts.
                return peak if dtype in (torch.bfloat16, torch.float16) else peak / 16
        warnings.warn(f"unknown GPU {name!r}: MFU is reported against a measured matmul peak; "
                      f"set train.peak_flops for the data-sheet value", stacklevel=2)
        a = torch.ones(4096, 4096, device=device, dtype=dtype)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)
        return 10 * 2 * 4096**3 / (time.perf_counter() - start)
    return measure_cpu_peak_flops(dtype)


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated by torch, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def model_flops_utilization(flops_per_token: float, tokens_per_s: float, peak_flops: float,
                            world_size: int = 1) -> float:
    """MFU: model FLOPs actually done per second over what the devices could do at peak."""
    if peak_flops <= 0:
        return 0.0
    return flops_per_token * tokens_per_s / (peak_flops * world_size)
