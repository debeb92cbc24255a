"""The machine line every benchmark prints beside its numbers: results are recorded per machine kind
(an AMX CPU runs bf16 matmuls ~6x fp32, AVX512_BF16 without AMX ~2x), so the CPU model and the
vector flags that decide torch's kernels go with every figure, and the load average says whether
the machine was quiet."""

from __future__ import annotations

import os
import platform

# The flags that choose torch's CPU kernels: AVX2/FMA, the AVX-512 family (bf16, vnni, ...), AMX.
KERNEL_FLAG_PREFIXES = ("avx512", "amx")
KERNEL_FLAGS = ("avx2", "fma")


def cpu_info() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    pairs = (line.split(":", 1) for line in first.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def kernel_flags(info: dict) -> list[str]:
    return [f for f in info.get("flags", "").split() if f.startswith(KERNEL_FLAG_PREFIXES) or f in KERNEL_FLAGS]


def cpu_model() -> str:
    return cpu_info().get("model name") or platform.processor() or platform.machine()


def cpu_line() -> str:
    """One line: model, cores, kernel flags, AMX or not, load average."""
    info = cpu_info()
    flags = kernel_flags(info)
    amx = "AMX" if any(f.startswith("amx") for f in flags) else "no AMX"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"CPU: {cpu_model()}, {os.cpu_count()} cores, {amx}; flags: {' '.join(flags) or 'none listed'}; "
        f"load average {load}"
    )
