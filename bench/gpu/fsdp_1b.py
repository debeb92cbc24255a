"""Tokens/s and MFU of Kiln's ~1B preset trained with FSDP2 + torch.compile + bf16 (and fp8 where
torchao and an fp8-capable GPU are present), printed next to torchtitan's published per-GPU numbers.
The fp8 run converts the model with the trainer's own kiln.train.precision.convert_to_fp8
(train.precision = "fp8": block linears to torchao's Float8Linear, head in bf16) under the
trainer's autocast, with --fp8-recipe as train.fp8_recipe.

Prepared for a short GPU lease (one H200, ~5 minutes of wall time): synthetic tokens (nothing is
downloaded or read from disk), PRESETS["1b"] (Llama 3.2 1B's shape) with Llama 3's 128,256-token
vocabulary, sequence 2048, a few warm-up steps (compilation happens there) and then ~20 timed steps.
The step is Kiln's own pieces, applied as the trainer applies them under a device mesh:
kiln.parallel.parallelize.apply_compile (each block compiled) and apply_fsdp (FSDP2 per block and
the root, bf16 parameters, fp32 gradient reduction), kiln.train.objective.next_token_loss under bf16
autocast, kiln.parallel.grad.clip_grad_norm at 1.0, and kiln.train.optim.build_optimizer (AdamW).
Kiln's Trainer itself does not shard on a single rank (ParallelDims.fsdp is false for a world of 1),
so this script builds the one-rank mesh and calls the same functions itself; under torchrun with
more GPUs it shards over all of them.

    python3 bench/gpu/fsdp_1b.py                           # one GPU (process group of 1 made here)
    torchrun --standalone --nproc-per-node 8 bench/gpu/fsdp_1b.py   # FSDP over 8 GPUs
    python3 bench/gpu/fsdp_1b.py --fp8 off --seq 4096 --batch 4
    python3 bench/gpu/fsdp_1b.py --smoke                   # CPU: tiny model, 2 timed steps, gloo

MFU = kiln.model.flops_per_token x tokens/s / peak, with the peak from
kiln.train.metrics.detect_peak_flops (H100/H200: 989e12 dense bf16). bench/gpu/README.md has the
lease recipe and how the published numbers compare.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a checkout runs without installing kiln

from kiln.model import build_model, count_params, flops_per_token, preset  # noqa: E402
from kiln.parallel.config import ParallelConfig  # noqa: E402
from kiln.parallel.grad import clip_grad_norm  # noqa: E402
from kiln.parallel.parallelize import apply_activation_checkpointing, apply_compile, apply_fsdp  # noqa: E402
from kiln.train.config import FP8_RECIPES, TrainConfig  # noqa: E402
from kiln.train.metrics import detect_peak_flops  # noqa: E402
from kiln.train.objective import next_token_loss  # noqa: E402
from kiln.train.optim import build_optimizer  # noqa: E402
from kiln.train.precision import autocast, convert_to_fp8, fp8_device_problem  # noqa: E402

LLAMA3_VOCAB = 128256
GiB = 2**30

# torchtitan's published per-GPU throughput (TPS/GPU = tokens per second per GPU). No 1B-class model
# is published; its Llama 3.1 8B runs used torchtitan's llama3_8b.toml, sequence length 8192.
# - pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (also docs/performance.md of that
#   time), Table 1: 8 H100 (HBM2e 96 GB, 500 W power limit), FSDP, local batch 2, selective AC.
# - pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Trainy): 4 nodes x 8 H200,
#   FSDP, compile, Float8 with float8 all-gather, local batch 2, TPS/GPU at iteration 100.
TORCHTITAN = [
    ("Llama 3.1 8B, 8x H100, FSDP (bf16)", 5762, False),
    ("Llama 3.1 8B, 8x H100, FSDP + compile (bf16)", 6667, False),
    ("Llama 3.1 8B, 8x H100, FSDP + compile + Float8", 8532, True),
    ("Llama 3.1 8B, 32x H200, FSDP + compile + Float8", 10938, True),
]
TORCHTITAN_SEQ = 8192


def setup(smoke: bool):
    """(device, rank, world): joins torchrun's group, or makes a group of one for a plain process."""
    cuda = torch.cuda.is_available() and not smoke
    backend = "nccl" if cuda else "gloo"
    if "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    else:
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return device, dist.get_rank(), dist.get_world_size()


def fp8_status(device: torch.device) -> str | None:
    """None when fp8 training can run here, else why not: Kiln's own device check (CUDA capability
    8.9+, or CPU) and whether torchao imports."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    problem = fp8_device_problem(device.type, capability)
    if problem:
        return problem
    try:
        importlib.import_module("torchao.float8")
    except ImportError as err:
        return f"torchao is not importable ({err}); pip install 'kiln[fp8]'"
    return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The aten ops F.scaled_dot_product_attention dispatches to, by backend (forward and backward); a
# profiled step's op names say which one ran, inside compiled code too (inductor calls them as
# extern kernels). No op at all means the attention was decomposed into matmuls (math).
SDPA_OPS = {
    "flash": ("_scaled_dot_product_flash_attention", "_flash_attention_forward"),
    "efficient": ("_scaled_dot_product_efficient_attention", "_efficient_attention_forward"),
    "cudnn": ("_scaled_dot_product_cudnn_attention",),
    "math": ("_scaled_dot_product_attention_math",),
}


def sdpa_backends(op_names) -> list[str]:
    """The SDPA backends whose aten ops appear among `op_names` (profiler event names)."""
    found = set()
    for name in op_names:
        op = name.removeprefix("aten::")
        for backend, prefixes in SDPA_OPS.items():
            if op.startswith(prefixes):
                found.add(backend)
    return sorted(found)


def _local_bytes(tensors) -> int:
    """Bytes of the tensors on this rank (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def state_bytes(params, optimizer) -> dict:
    """Model-state bytes on this rank, read off the tensors: parameters, gradients (call after
    backward, before the optimizer step), optimizer state."""
    return {
        "params": _local_bytes(params),
        "grads": _local_bytes(p.grad for p in params),
        "optimizer": _local_bytes(v for state in optimizer.state.values() for v in state.values()),
    }


def run(name: str, cfg, args, device, rank: int, world: int, fp8: bool, peak: float, ac: str = "none") -> dict:
    """Build, shard and train the model for args.warmup + args.steps steps of args.batch sequences;
    `ac` is the activation-checkpointing mode (kiln.parallel.parallelize, applied before compile as
    the trainer's parallelize orders them)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = build_model(cfg, device=device)
    # The trainer's conversion (kiln.train.precision): block linears to Float8Linear, head in bf16.
    converted = convert_to_fp8(model, args.fp8_recipe)[0] if fp8 else 0
    apply_activation_checkpointing(model, ac)
    if args.compile:
        apply_compile(model)  # before FSDP, as kiln.parallel.parallelize orders them
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    apply_fsdp(model, mesh, ParallelConfig(dp_shard=world), torch.bfloat16)
    optimizer = build_optimizer(model, TrainConfig(lr=3e-4, warmup_steps=0, max_steps=10**6))
    params = list(model.parameters())
    generator = torch.Generator(device=device).manual_seed(1000 + rank)
    states = {}

    def step(measure: bool = False) -> torch.Tensor:
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), device=device, generator=generator)
        with autocast("fp8" if fp8 else "bf16", device):
            loss, _ = next_token_loss(model, (tokens[:, :-1], tokens[:, 1:]))
        loss.backward()
        if measure:  # the gradients' peak; the optimizer state of the previous steps
            states.update(state_bytes(params, optimizer))
        clip_grad_norm(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    started = time.perf_counter()
    first = step()
    for _ in range(args.warmup - 1):
        step()
    sync(device)
    warmup_s = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        sync(device)  # per-step times show the spread; a sync costs ~nothing next to a step
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    max_allocated = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    max_reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    # One more step, untimed, under the profiler (after the memory peak is read): which SDPA kernels
    # ran, and the model states' bytes.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(measure=True)
        sync(device)
    sdpa = sdpa_backends(e.name for e in prof.events())
    losses = [float(x) for x in losses]
    tokens_step = args.batch * args.seq  # per rank
    per_gpu = tokens_step / statistics.median(times)
    result = {
        "name": name,
        "fp8_linears": converted,
        "fp8_recipe": args.fp8_recipe if fp8 else None,
        "compile": args.compile,
        "world": world,
        "ac": ac,
        "batch": args.batch,
        "seq": args.seq,
        "tokens_per_step_per_gpu": tokens_step,
        "warmup_s": warmup_s,
        "step_s_median": statistics.median(times),
        "step_s_min": min(times),
        "step_s_max": max(times),
        "tokens_per_s_per_gpu": per_gpu,
        "mfu": flops_per_token(cfg, args.seq) * per_gpu / peak,
        "loss_first": float(first),
        "loss_last": losses[-1],
        "max_allocated_gib": None if max_allocated is None else max_allocated / GiB,
        "max_reserved_gib": None if max_reserved is None else max_reserved / GiB,
        "max_allocated_bytes": max_allocated,
        "state_bytes": dict(states),
        "sdpa_backends": sdpa,
    }
    if not all(math.isfinite(x) for x in [result["loss_first"], *losses]):
        raise RuntimeError(f"{name}: non-finite loss {losses}")
    return result


def release(device: torch.device) -> None:
    """Free the finished run's model and optimizer before the next run builds its own, and its
    compiled blocks: the next run compiles its own, not under guards left by this one (nor past
    dynamo's recompile limit, which would silently run blocks eagerly)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def report(results: list[dict], cfg, peak: float, device_name: str) -> str:
    ref = preset("8b", vocab_size=LLAMA3_VOCAB)
    ref_flops = flops_per_token(ref, TORCHTITAN_SEQ)
    lines = [
        f"device: {device_name}; peak {peak / 1e12:.1f} TFLOP/s (bf16 dense); model {count_params(cfg) / 1e9:.3f}B "
        f"parameters, {flops_per_token(cfg, results[0]['seq']) / 1e9:.2f} GFLOP/token at seq {results[0]['seq']}",
        "",
        "| run | tokens/s/GPU | MFU | step s (median, min-max) | peak mem GiB (alloc/reserved) | warm-up s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        mem = "-" if r["max_allocated_gib"] is None else f"{r['max_allocated_gib']:.1f} / {r['max_reserved_gib']:.1f}"
        mfu = f"{100 * r['mfu']:.1f}%" + (" (bf16-equivalent)" if r["fp8_linears"] else "")
        lines.append(
            f"| Kiln {cfg.preset} preset, {r['name']} | {r['tokens_per_s_per_gpu']:,.0f} | {mfu} "
            f"| {r['step_s_median']:.3f} ({r['step_s_min']:.3f}-{r['step_s_max']:.3f}) | {mem} "
            f"| {r['warmup_s']:.0f} |"
        )
    # The published rows in MFU terms, with Kiln's FLOP count for Llama 3.1 8B at sequence 8192
    # against the H100/H200 SXM dense bf16 peak (989 TFLOP/s). torchtitan's H100s ran at 500 W with
    # HBM2e, below the SXM peak, so these MFUs understate theirs; fp8 rows count fp8 matmuls as if
    # bf16 (torchtitan itself reports no MFU for them).
    for label, tps, fp8 in TORCHTITAN:
        mfu = ref_flops * tps / 989e12
        lines.append(
            f"| torchtitan {label} | {tps:,} | {100 * mfu:.1f}%{' (bf16-equivalent)' if fp8 else ''} | - | - | - |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU check: tiny model, 2 timed steps, gloo")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument(
        "--fp8",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: also run fp8 where torchao and the device allow it (an fp8 GPU, or CPU under --smoke)",
    )
    parser.add_argument(
        "--fp8-recipe", choices=FP8_RECIPES, default="tensorwise", help="torchao's float8 scaling (train.fp8_recipe)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=270.0,
        help="skip the fp8 run if the bf16 run left less than its own time of this budget",
    )
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.batch, args.steps, args.warmup = 128, 2, 2, 1
    start = time.perf_counter()
    device, rank, world = setup(args.smoke)
    cfg = preset("tiny", vocab_size=8192) if args.smoke else preset("1b", vocab_size=LLAMA3_VOCAB)
    if args.seq > cfg.max_seq_len:
        parser.error(f"--seq {args.seq} exceeds the model's max_seq_len {cfg.max_seq_len}")
    peak = detect_peak_flops(device, torch.bfloat16)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (measured matmul peak)"
    log = print if rank == 0 else (lambda *a, **k: None)
    log(
        f"torch {torch.__version__}; {device_name}; world {world}; seq {args.seq} x batch {args.batch}; "
        f"compile {args.compile}",
        flush=True,
    )

    why_not = fp8_status(device)
    if args.fp8 == "on" and why_not:
        parser.error(f"--fp8 on: {why_not}")
    results = [
        run("FSDP2 + compile + bf16" if args.compile else "FSDP2 + bf16", cfg, args, device, rank, world, False, peak)
    ]
    log(json.dumps(results[-1]), flush=True)
    release(device)
    if args.fp8 != "off" and why_not is None:
        spent = time.perf_counter() - start
        if args.fp8 == "on" or spent * 2 < args.budget_s:
            name = f"FSDP2{' + compile' if args.compile else ''} + fp8 {args.fp8_recipe} (torchao)"
            results.append(run(name, cfg, args, device, rank, world, True, peak))
            log(json.dumps(results[-1]), flush=True)
        else:
            log(f"fp8 skipped: the bf16 run took {spent:.0f} s of the {args.budget_s:.0f} s budget", flush=True)
    elif args.fp8 != "off":
        log(f"fp8 skipped: {why_not}", flush=True)
    log("\n" + report(results, cfg, peak, device_name), flush=True)
    log(f"\ntotal {time.perf_counter() - start:.0f} s", flush=True)
    if args.json and rank == 0:
        Path(args.json).write_text(
            json.dumps(
                {"device": device_name, "peak_flops": peak, "torch": torch.__version__, "results": results}, indent=1
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
