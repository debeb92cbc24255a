"""NVMe offload of AdamW's state: step time and peak RSS, in memory vs `train.optimizer_offload = "nvme"`.

Each mode runs in a fresh process (peak RSS is per process: resource.getrusage ru_maxrss), which
builds Kiln's Transformer, runs warmup + timed steps (forward, backward, clipping, the optimizer
step from kiln.train.optim.build_optimizer) and reports:
- RSS with parameters and gradients resident, before the optimizer's first step (the floor);
- peak RSS over the steps, and what it adds to the floor (the optimizer state held in memory);
- median step time and median optimizer-step time;
- peak RSS after one `optimizer.state_dict()` (what a checkpoint save builds: the whole state).

On a CPU device "CPU offload" (FSDP2's parallel.offload, which moves GPU state to host memory) is
the in-memory run: the state already lives in host memory, so there is no third mode to run.

    python bench/nvme_offload.py                      # ~91M parameters
    python bench/nvme_offload.py --dim 1024 --layers 8 --steps 3   # ~167M parameters
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.model import ModelConfig, build_model, count_params
from kiln.train.config import TrainConfig
from kiln.train.objective import next_token_loss
from kiln.train.optim import build_optimizer


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise OSError("no VmRSS in /proc/self/status")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(args) -> dict:
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64, n_kv_heads=args.dim // 64,
        max_seq_len=args.seq,
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg)
    offload = dict(optimizer_offload="nvme", optimizer_offload_chunk_mb=args.chunk_mb) if args.mode == "nvme" else {}
    train = TrainConfig(precision="fp32", **offload)
    swap = tempfile.mkdtemp(prefix="nvme-bench-", dir=args.swap_dir)
    opt = build_optimizer(model, train, offload_dir=swap)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    floor = None
    steps, opt_steps = [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss, _ = next_token_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if floor is None:
            floor = _rss_mb()
        opt_start = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated, as between the steps of a run
        if i >= args.warmup:
            steps.append(end - start)
            opt_steps.append(end - opt_start)
    peak = _peak_mb()
    opt.state_dict()
    result = {
        "mode": args.mode,
        "params": count_params(cfg),
        "floor_mb": floor,
        "peak_mb": peak,
        "step_s": statistics.median(steps),
        "opt_step_s": statistics.median(opt_steps),
        "peak_after_state_dict_mb": _peak_mb(),
    }
    if args.mode == "nvme":
        result["resident_state_mb"] = opt.resident_state_bytes() / 2**20
        opt.close()
    os.rmdir(swap)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-mb", type=int, default=64)
    parser.add_argument("--swap-dir", default=None, help="folder for the swap files (default: the system temp dir)")
    parser.add_argument("--mode", choices=["memory", "nvme"], help=argparse.SUPPRESS)  # a child process's mode
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(child(args)))
        return
    print(f"torch {torch.__version__}, {args.threads} threads\n{cpu_line()}")
    print('On CPU, "CPU offload" is the in-memory run: AdamW\'s state already lives in host memory.')
    rows = []
    for mode in ("memory", "nvme"):
        out = subprocess.run(
            [sys.executable, *sys.argv, "--mode", mode], check=True, capture_output=True, text=True
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"model: dim {args.dim}, {args.layers} layers, vocab {args.vocab}, {rows[0]['params'] / 1e6:.0f}M parameters "
        f"(fp32 AdamW state {rows[0]['params'] * 8 / 2**20:.0f} MiB); batch {args.batch}x{args.seq}, "
        f"chunk {args.chunk_mb} MiB, {args.steps} timed steps after {args.warmup} warmup"
    )
    print(
        f"{'mode':8} {'params+grads RSS':>17} {'peak RSS':>9} {'peak - floor':>13} {'step s':>7} "
        f"{'opt.step s':>10} {'peak w/ state_dict':>19}"
    )
    for r in rows:
        print(
            f"{r['mode']:8} {r['floor_mb']:>14.0f} MB {r['peak_mb']:>6.0f} MB {r['peak_mb'] - r['floor_mb']:>10.0f} MB "
            f"{r['step_s']:>7.2f} {r['opt_step_s']:>10.2f} {r['peak_after_state_dict_mb']:>16.0f} MB"
        )
    memory, nvme = rows
    print(
        f"nvme / memory: peak RSS x{nvme['peak_mb'] / memory['peak_mb']:.2f}, "
        f"optimizer memory above the floor {memory['peak_mb'] - memory['floor_mb']:.0f} -> "
        f"{nvme['peak_mb'] - nvme['floor_mb']:.0f} MB (two chunk buffers: {nvme['resident_state_mb']:.0f} MiB), "
        f"step time x{nvme['step_s'] / memory['step_s']:.2f}"
    )


if __name__ == "__main__":
    main()
