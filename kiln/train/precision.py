"""Training precision: the dtype of each `precision` setting and the autocast the training loop runs
its forward passes under. Anything that must compute what the loop computes (DPO's reference
log-probs, PPO's rollout log-probs) uses the same `autocast`, so the numbers agree bit for bit.

`fp8` is torchtitan's float8 recipe through torchao: the block linears become torchao's
`Float8Linear` (each matmul casts its inputs to float8 with dynamic scales, `tensorwise` or
`rowwise`) and everything else runs under bf16 autocast, with fp32 master weights, so checkpoints
are the same as bf16's."""

from __future__ import annotations

import functools
import re
from contextlib import nullcontext

import torch
import torch.nn as nn

from kiln.errors import ConfigError
from kiln.model.moe import GroupedExperts
from kiln.peft.adapter import adapter_modules
from kiln.peft.lora import lora_modules
from kiln.train.config import FP8_RECIPES
from kiln.train.metrics import measure_cpu_peak_flops

# fp8: the dtype of everything that is not a float8 matmul (autocast, FSDP's all-gathered weights).
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
DEFAULT_FP8_RECIPE = "tensorwise"  # torchtitan's default float8 recipe
# float8 tensor cores arrived with Ada (8.9) and Hopper (9.0); torch._scaled_mm refuses older GPUs.
FP8_MIN_CAPABILITY = (8, 9)
# torch._scaled_mm needs both matmul dims divisible by 16.
FP8_DIM_MULTIPLE = 16
# A linear inside a transformer block: not the output head, an RM's scalar head or PPO's critic head.
_BLOCK_LINEAR = re.compile(r"(^|\.)layers\.\d+\.")


# "auto" takes bf16 only where its matmuls beat fp32's by this much. A CPU without bf16 kernels
# (AVX2 only: no AVX512_BF16, no AMX) runs them through a reference loop, 78x slower than fp32 on a
# Zen 3 EPYC; AVX512_BF16 gives ~2x fp32 and AMX ~6x (docs/benchmarks.md, "Machine kinds").
AUTO_BF16_MIN_SPEEDUP = 1.2
# An explicit bf16 this much slower than fp32 gets a warning: the run would crawl.
BF16_SLOW_WARNING = 0.5
AUTO_PROBE_N = 256  # a 256^3 matmul: ~40 ms even through the slow bf16 loop


@functools.lru_cache(maxsize=None)
def cpu_bf16_speedup() -> tuple[float, float]:
    """(fp32, bf16) matmul FLOP/s of this CPU, measured once per process: flags (avx512_bf16,
    amx_bf16) say what the CPU has, not what this torch build's kernels use."""
    return tuple(
        measure_cpu_peak_flops(dtype, seconds=0.05, n=AUTO_PROBE_N) for dtype in (torch.float32, torch.bfloat16)
    )


def cpu_bf16_is_fast() -> bool:
    """Whether this CPU's bf16 matmuls beat fp32's by AUTO_BF16_MIN_SPEEDUP (measured once per process)."""
    fp32, bf16 = cpu_bf16_speedup()
    return bf16 >= AUTO_BF16_MIN_SPEEDUP * fp32


@functools.lru_cache(maxsize=None)
def _resolve(precision: str, device_type: str) -> tuple[str, str | None]:
    if device_type == "cuda":
        if precision != "auto":
            return precision, None
        chosen = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        return chosen, f"note: train.precision = auto: {chosen} on this GPU"
    if device_type != "cpu":
        return (
            ("fp32", f"note: train.precision = auto: fp32 on {device_type}")
            if precision == "auto"
            else (precision, None)
        )
    if precision not in ("auto", "bf16"):
        return precision, None
    fp32, bf16 = cpu_bf16_speedup()
    rates = f"bf16 matmuls at {bf16 / 1e9:.1f} GFLOP/s against fp32's {fp32 / 1e9:.1f}"
    if precision == "bf16":
        if bf16 < BF16_SLOW_WARNING * fp32:
            return "bf16", (
                f'warning: train.precision = "bf16" on this CPU: {rates} (no bf16 matmul kernels); '
                f'precision = "auto" would train in fp32 here'
            )
        return "bf16", None
    chosen = "bf16" if cpu_bf16_is_fast() else "fp32"
    return chosen, f"note: train.precision = auto: {chosen} on this CPU ({rates})"


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> tuple[str, str | None]:
    """The precision a run computes in, and the line to print about it (None: nothing to say).
    "auto" is bf16 on a GPU that supports it and on a CPU whose bf16 matmuls are faster than fp32
    (measured), else fp32; an explicit "bf16" on a CPU that runs it far slower than fp32 is kept,
    with a warning. One answer per device kind and process."""
    return _resolve(precision, torch.device(device).type)


def autocast(precision: str, device: torch.device | str = "cpu"):
    """The training loop's autocast for `precision` on `device` (fp32: no autocast at all)."""
    if precision == "auto":
        precision = resolve_precision(precision, device)[0]
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=PRECISION_DTYPES[precision])


def fp8_device_problem(device_type: str, capability: tuple[int, int] | None = None) -> str | None:
    """Why fp8 training cannot run on this device (None: it can). `capability` is the CUDA
    compute capability; a separate argument so the check is testable without a GPU."""
    if device_type == "cpu":
        return None  # torch._scaled_mm has a CPU kernel: slow, but the numerics are the GPU's
    if device_type != "cuda":
        return f"fp8 training runs on CUDA GPUs (and CPU), not on {device_type!r}"
    if capability is None or tuple(capability) < FP8_MIN_CAPABILITY:
        need = ".".join(map(str, FP8_MIN_CAPABILITY))
        have = ".".join(map(str, capability)) if capability else "unknown"
        return f"fp8 needs a GPU of compute capability >= {need} (Ada, Hopper or newer); this one has {have}"
    return None


def check_fp8_device(device: torch.device) -> None:
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    problem = fp8_device_problem(device.type, capability)
    if problem:
        raise ConfigError("precision", problem)


def _torchao_float8():
    try:
        import torchao.float8 as float8  # optional: only fp8 training needs it
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        raise ConfigError(
            "precision", "fp8 needs the `torchao` package (pip install 'kiln[fp8]', torchao>=0.17)"
        ) from None
    return float8, Float8Linear


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """A linear that fp8 converts: inside a block and with both dims divisible by 16. The output
    head stays in bf16 as torchtitan keeps it (its logits feed the softmax over the whole
    vocabulary, where float8's 2-3 significant bits would show in the loss)."""
    return (
        isinstance(module, nn.Linear)
        and _BLOCK_LINEAR.search(fqn) is not None
        and module.in_features % FP8_DIM_MULTIPLE == 0
        and module.out_features % FP8_DIM_MULTIPLE == 0
    )


def convert_to_fp8(model: nn.Module, recipe: str = "") -> tuple[int, list[str]]:
    """Swap `model`'s eligible block linears for torchao's Float8Linear in place, with `recipe`'s
    scaling ("": tensorwise). Parameter names and dtypes are unchanged, so state dicts and
    checkpoints are too. Returns (linears converted, block linears left in bf16 for their shape).
    Runs before tensor parallelism, checkpointing, compile and FSDP, in torchtitan's order."""
    recipe = recipe or DEFAULT_FP8_RECIPE
    if recipe not in FP8_RECIPES:
        raise ConfigError("fp8_recipe", f"must be one of {', '.join(FP8_RECIPES)}, got {recipe!r}")
    if any(isinstance(m, GroupedExperts) for m in model.modules()):
        raise ConfigError(
            "precision", "fp8 does not cover MoE expert weights (grouped matmuls); train MoE models in bf16"
        )
    if lora_modules(model) or adapter_modules(model):
        raise ConfigError("precision", "fp8 trains full weights; LoRA, QLoRA and adapters (peft) train in bf16 or fp32")
    float8, float8_linear = _torchao_float8()
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    left_out = [name for name, m in linears.items() if _BLOCK_LINEAR.search(name) and not fp8_eligible(m, name)]
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=fp8_eligible)
    converted = sum(isinstance(m, float8_linear) for m in model.modules())
    if converted == 0:
        raise ConfigError(
            "precision", f"fp8 found no block linear with both dims divisible by {FP8_DIM_MULTIPLE} to convert"
        )
    return converted, left_out


def fp8_linears(model: nn.Module) -> int:
    """How many of `model`'s modules compute in float8 (0 without torchao)."""
    try:
        from torchao.float8.float8_linear import Float8Linear  # optional dependency
    except ImportError:
        return 0
    return sum(isinstance(m, Float8Linear) for m in model.modules())
