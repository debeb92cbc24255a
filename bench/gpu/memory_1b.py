"""Measured GPU memory of Kiln's ~1B preset against the planner's prediction, for activation
checkpointing none / selective / full x two micro-batch sizes, with tokens/s, MFU and the SDPA
backend that ran in each case, and the fp8 (torchao) run where it applies: one command for a GPU lease.

Each case is fsdp_1b.py's step (FSDP2 on a one-rank mesh, per-block compile, bf16 parameters,
fp32 gradient reduction, Kiln's loss, clipping and AdamW) with
kiln.parallel.parallelize.apply_activation_checkpointing applied first, as the trainer's
parallelize orders them. torch.cuda.max_memory_allocated is read over the timed steps, after
reset_peak_memory_stats; the model states (parameters, gradients, optimizer state) are read off the
tensors. The prediction is kiln.parallel.plan.memory for Layout(dp_shard=1, zero=3, ac, micro_batch):
the planner's one-rank FSDP layout, which is what runs (bench/gpu/README.md says why not
plan_check.trainer_memory).

    python3 bench/gpu/memory_1b.py --json $OUT/memory_1b.json     # one GPU, under --budget-s
    python3 bench/gpu/memory_1b.py --micro-batches 2,4 --fp8 off
    python3 bench/gpu/memory_1b.py --smoke                        # CPU: tiny model, every case
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fsdp_1b beside it
import fsdp_1b  # noqa: E402  (it puts the checkout on sys.path)

from kiln.model import ModelConfig, preset  # noqa: E402
from kiln.model.config import AC_MODES  # noqa: E402
from kiln.parallel.hardware import GB  # noqa: E402
from kiln.parallel.plan import Layout, Memory, Workload, memory  # noqa: E402
from kiln.train.config import FP8_RECIPES  # noqa: E402
from kiln.train.metrics import detect_peak_flops  # noqa: E402

PLANNER_TERMS = ("params", "grads", "optimizer", "activations", "logits", "buffers")
STATE_TERMS = ("params", "grads", "optimizer")
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
# --smoke's model: the 1B preset's structure (grouped KV heads, SwiGLU, tied head) at a size whose
# steps take milliseconds on a busy CPU.
SMOKE_MODEL = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


PLANNER_LAYOUT = "Layout(dp_shard=1, zero=3, ac=AC, micro_batch=MB)"


def planner_layout(ac: str, micro_batch: int) -> Layout:
    """The planner's layout for what each case runs: FSDP (ZeRO-3, parameters resharded after
    forward) over a one-rank data-parallel shard, one micro-batch per step."""
    return Layout(dp_shard=1, zero=3, ac=ac, micro_batch=micro_batch)


def predict(cfg, seq: int, ac: str, micro_batch: int) -> Memory:
    return memory(cfg, planner_layout(ac, micro_batch), Workload(seq, micro_batch * seq))


def compare(predicted: Memory, measured_peak: int | None, states: dict) -> dict:
    """Planner vs measured: the model states (exact, from tensors; the planner splits the same 16
    bytes per parameter 2 + 2 + 12 where the run holds fp32 4 + 4 + 8, so only their sum compares),
    and on a GPU the peak total and what the peak holds beyond the states."""
    planned_states = sum(getattr(predicted, t) for t in STATE_TERMS)
    measured_states = sum(states[t] for t in STATE_TERMS)
    out = {
        "states_planned": planned_states,
        "states_measured": measured_states,
        "states_ratio": measured_states / planned_states,
        "peak_measured": measured_peak,
        "peak_ratio": None,
        "beyond_states_ratio": None,
    }
    if measured_peak is not None:
        out["peak_ratio"] = measured_peak / predicted.total
        out["beyond_states_ratio"] = (measured_peak - measured_states) / (predicted.total - planned_states)
    return out


def probe_sdpa(cfg, seq: int, device: torch.device) -> dict:
    """Which SDPA backends accept this model's attention (bf16, causal, grouped KV heads, the
    model's head size), each forced in turn with torch.nn.attention.sdpa_kernel, forward and backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
    names["math"] = "MATH"
    shape_q, shape_kv = (1, cfg.n_heads, seq, cfg.head_dim), (1, cfg.kv_heads, seq, cfg.head_dim)
    q = torch.randn(shape_q, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape_kv, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = {}
    for backend in SDPA_BACKENDS:
        try:
            with sdpa_kernel(getattr(SDPBackend, names[backend])):
                y = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=cfg.kv_heads != cfg.n_heads
                )
                y.sum().backward()
            out[backend] = "ok"
        except (RuntimeError, NotImplementedError) as err:  # "No available kernel"; torch warns why
            out[backend] = f"refused: {str(err).splitlines()[0][:120]}"
    return out


def cases(args) -> list[dict]:
    """AC mode x micro-batch, the fsdp_1b.py configuration (no AC, largest micro-batch) first."""
    sizes = sorted(args.micro_batches, reverse=True)
    return [{"ac": ac, "batch": mb, "fp8": False} for ac in args.ac for mb in sizes]


def capacity_bytes(device: torch.device, override_gb: float | None) -> float:
    if override_gb is not None:
        return override_gb * GB
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def case_name(case: dict) -> str:
    return f"ac={case['ac']} mb={case['batch']}" + (" fp8" if case["fp8"] else "")


def run_all(args, cfg, device, rank, world, peak, log, start: float, done=lambda entry: None) -> list[dict]:
    """Every case in order, each skipped (with the reason recorded) when the planner puts it over
    the device's memory, when the time left in --budget-s is less than the slowest case so far,
    or, for fp8, when fp8 cannot run here. `start`: when the command started (perf_counter);
    `done(entry)` is called after each case."""
    capacity = capacity_bytes(device, args.capacity_gb)
    todo = cases(args)
    if args.fp8 != "off":  # fp8 where it matters most: no AC, the largest micro-batch
        todo.append({"ac": "none", "batch": max(args.micro_batches), "fp8": True})
    why_not_fp8 = fsdp_1b.fp8_status(device)
    slowest, results = 0.0, []
    for case in todo:
        predicted = predict(cfg, args.seq, case["ac"], case["batch"])
        entry = {
            "case": case_name(case),
            **case,
            "planner_layout": planner_layout(case["ac"], case["batch"]).label(),
            "planner_bytes": {t: getattr(predicted, t) for t in PLANNER_TERMS} | {"total": predicted.total},
        }
        elapsed = time.perf_counter() - start
        if predicted.total > capacity:
            entry["skipped"] = f"planner predicts {predicted.total / GB:.1f} GB > {capacity / GB:.1f} GB on the device"
        elif case["fp8"] and why_not_fp8:
            entry["skipped"] = why_not_fp8
        elif elapsed + slowest > args.budget_s:
            entry["skipped"] = (
                f"budget: {elapsed:.0f} s spent, the slowest case took {slowest:.0f} s, --budget-s {args.budget_s:.0f}"
            )
        else:
            case_args = copy.copy(args)
            case_args.batch = case["batch"]
            t0 = time.perf_counter()
            try:
                res = fsdp_1b.run(entry["case"], cfg, case_args, device, rank, world, case["fp8"], peak, ac=case["ac"])
            except torch.cuda.OutOfMemoryError as err:
                entry["skipped"] = f"out of memory: {str(err).splitlines()[0][:160]}"
            except Exception as err:  # one broken case must not cost the lease the others' numbers
                traceback.print_exc()
                entry["skipped"] = f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
            else:
                entry |= {"result": res, **compare(predicted, res["max_allocated_bytes"], res["state_bytes"])}
            fsdp_1b.release(device)
            entry["case_s"] = time.perf_counter() - t0
            slowest = max(slowest, entry["case_s"])
        log(json.dumps(entry), flush=True)
        results.append(entry)
        done(entry)
    return results


def report(results: list[dict]) -> str:
    # --smoke's model is a few MB: GB would print zeros.
    unit, size = ("GB", GB) if max(e["planner_bytes"]["total"] for e in results) > GB else ("MB", 1e6)
    amount = lambda x: "-" if x is None else f"{x / size:.2f}"  # noqa: E731
    lines = [
        f"| case | planner params / grads / optimizer / activations / logits / buffers {unit} | planner total {unit} "
        f"| measured max allocated {unit} | measured / planner | states measured / planner | tokens/s | MFU | SDPA |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in results:
        p = e["planner_bytes"]
        terms = " / ".join(amount(p[t]) for t in PLANNER_TERMS)
        if "skipped" in e:
            lines.append(f"| {e['case']} | {terms} | {amount(p['total'])} | skipped: {e['skipped']} | | | | | |")
            continue
        r = e["result"]
        ratio = "-" if e["peak_ratio"] is None else f"{e['peak_ratio']:.2f}"
        lines.append(
            f"| {e['case']} | {terms} | {amount(p['total'])} | {amount(e['peak_measured'])} | {ratio} "
            f"| {e['states_ratio']:.3f} | {r['tokens_per_s_per_gpu']:,.0f} | {100 * r['mfu']:.1f}% "
            f"| {', '.join(r['sdpa_backends']) or 'none (decomposed)'} |"
        )
    return "\n".join(lines)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU check: tiny model, every case, no compile")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8], help="e.g. 4,8"
    )
    parser.add_argument("--ac", type=lambda s: s.split(","), default=list(AC_MODES), help="e.g. none,full")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--fp8", choices=("auto", "on", "off"), default="auto", help="auto: fp8 case where possible")
    parser.add_argument(
        "--fp8-recipe", choices=FP8_RECIPES, default="tensorwise", help="torchao's float8 scaling (train.fp8_recipe)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=400.0,
        help="start no case once the time spent plus the slowest case so far would pass this",
    )
    parser.add_argument("--capacity-gb", type=float, help="device memory to plan against (default: the device's)")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args(argv)
    bad = [m for m in args.ac if m not in AC_MODES]
    if bad:
        parser.error(f"--ac: {', '.join(bad)} not among {', '.join(AC_MODES)}")
    if any(mb < 1 for mb in args.micro_batches):
        parser.error("--micro-batches: sizes must be positive")
    if args.smoke:
        # CPU inductor would compile every case for minutes; fsdp_1b.py --smoke covers compile.
        args.seq, args.micro_batches, args.steps, args.warmup, args.compile = 64, [1, 2], 1, 1, False
    return parser, args


def main(argv=None) -> dict:
    parser, args = parse(argv)
    start = time.perf_counter()
    device, rank, world = fsdp_1b.setup(args.smoke)
    if world != 1:
        parser.error("memory_1b.py compares against the planner's one-rank layout: run it as one process")
    cfg = SMOKE_MODEL if args.smoke else preset("1b", vocab_size=fsdp_1b.LLAMA3_VOCAB)
    if args.seq > cfg.max_seq_len:
        parser.error(f"--seq {args.seq} exceeds the model's max_seq_len {cfg.max_seq_len}")
    peak = detect_peak_flops(device, torch.bfloat16)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (measured matmul peak)"
    log = print
    log(f"torch {torch.__version__}; {device_name}; seq {args.seq}; compile {args.compile}", flush=True)
    log(f"planner: kiln.parallel.plan.memory, {PLANNER_LAYOUT} (one-rank FSDP)", flush=True)
    for case in cases(args):
        log(f"  predicted {case_name(case)}: {predict(cfg, args.seq, case['ac'], case['batch']).as_gb()}", flush=True)
    probe = probe_sdpa(cfg, args.seq, device)
    log(f"SDPA backends accepting this attention: {probe}", flush=True)
    out = {
        "device": device_name,
        "torch": torch.__version__,
        "peak_flops": peak,
        "seq": args.seq,
        "compile": args.compile,
        "planner_layout": PLANNER_LAYOUT,
        "sdpa_probe": probe,
        "budget_s": args.budget_s,
        "total_s": None,
        "cases": [],
    }

    def done(entry: dict) -> None:
        # Written after every case, so a run cut short by the lease still leaves what it measured.
        out["cases"].append(entry)
        out["total_s"] = time.perf_counter() - start
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))

    results = run_all(args, cfg, device, rank, world, peak, log, start, done)
    log("\n" + report(results), flush=True)
    skipped = [e["case"] for e in results if "skipped" in e]
    log(f"\ntotal {out['total_s']:.0f} s; {len(results) - len(skipped)} ran, skipped: {', '.join(skipped) or 'none'}")
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
