"""DiLoCo against DDP at the same token budget: validation loss and gradient/weight traffic.

Every mode is a 2-rank torchrun job on this machine (gloo, CPU) run by bench/scaling.py's worker:
the same small model, data (the tiny recipe's pack) and global batch, for --steps steps, so each
mode sees the same tokens. DDP all-reduces the gradients every step; DiLoCo all-reduces the
pseudo-gradients every H steps (streaming: one of F fragments every H / F steps); the averaging
modes are DiLoCo with an outer SGD of lr 1 and no momentum. Reported per mode: the final
validation loss (16 global batches of the validation split; DiLoCo's last step synchronises every
fragment, so it is the replicas' common model), the number of model-sized all-reduces per rank
(a fragment's counts 1/F), and the wall time.

    .venv/bin/python bench/diloco.py                  # the table in docs/parallel.md, ~2 min a mode
    .venv/bin/python bench/diloco.py --steps 100 --modes ddp,diloco_h10
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_line  # bench/ (the script's folder, on sys.path)
from scaling import find_pack, torchrun  # bench/ is the script's folder, so on sys.path

from kiln.parallel.diloco import fragments_due

MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=192, max_seq_len=128, vocab_size=8192)
SEQ_LEN, MICRO_BATCH = 128, 4
DILOCO = {"outer": "diloco", "outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True}
AVERAGE = {"outer": "diloco", "outer_lr": 1.0, "outer_momentum": 0.0, "outer_nesterov": False}
MODES = {  # name: the [parallel] table beyond the 2 replicas
    "ddp": {},
    "diloco_h10": {**DILOCO, "outer_steps": 10},
    "diloco_h50": {**DILOCO, "outer_steps": 50},
    "streaming_h50_f5": {**DILOCO, "outer_steps": 50, "outer_fragments": 5},
    # Plain weight averaging (outer SGD, lr 1, no momentum): DiLoCo without its outer optimizer.
    "average_h1": {**AVERAGE, "outer_steps": 1},
    "average_h10": {**AVERAGE, "outer_steps": 10},
}


def model_all_reduces(parallel: dict, steps: int) -> float:
    """Model-sized all-reduces per rank over the run (a fragment's counts 1/F): every step for DDP;
    for DiLoCo the fragments due by its schedule, and all of them after the last step."""
    if parallel.get("outer") != "diloco":
        return float(steps)
    h, f = parallel["outer_steps"], parallel.get("outer_fragments", 1)
    return (sum(len(fragments_due(s, h, f)) for s in range(1, steps)) + f) / f


def run(name: str, pack: Path, out: Path, steps: int, lr: float) -> dict:
    parallel = MODES[name]
    spec = {
        "pack": str(pack),
        "parallel": {"dp_replicate": 2, "dp_shard": 1, **parallel},
        "model": MODEL,
        "train": dict(
            seq_len=SEQ_LEN,
            micro_batch_size=MICRO_BATCH,
            global_batch_tokens=2 * MICRO_BATCH * SEQ_LEN,
            max_steps=steps,
            lr=lr,
            warmup_steps=steps // 20,
            precision="fp32",
            log_every=steps,
            eval_every=steps,
            eval_batches=16,
            ckpt_every=steps,
            keep_best=False,
            threads=1,
            peak_flops=1e12,
        ),
    }
    out.mkdir(parents=True)
    started = time.perf_counter()
    torchrun(2, ["--worker", "train", str(out), json.dumps(spec)], threads=1, timeout=1800)
    summary = json.loads((out / "rank-0.json").read_text())["summary"]
    return {
        "mode": name,
        "val_loss": summary["final_val_loss"],
        "tokens": summary["tokens_seen"],
        "all_reduces": model_all_reduces(parallel, steps),
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--pack", default=None, help="a pack folder; default runs/tiny/pack or a fresh one")
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    with tempfile.TemporaryDirectory(prefix="kiln-diloco-") as tmp:
        pack = find_pack(args.pack, Path(tmp))
        rows = [run(m, pack, Path(tmp) / m, args.steps, args.lr) for m in args.modes.split(",")]
    ddp = next((r for r in rows if r["mode"] == "ddp"), None)
    print(f"{'mode':<18} {'val loss':>9} {'vs ddp':>8} {'all-reduces':>12} {'wall s':>7}  ({rows[0]['tokens']} tokens)")
    for r in rows:
        ratio = f"{r['val_loss'] / ddp['val_loss']:.3f}" if ddp else "-"
        print(f"{r['mode']:<18} {r['val_loss']:>9.4f} {ratio:>8} {r['all_reduces']:>12.1f} {r['wall_s']:>7.1f}")


if __name__ == "__main__":
    sys.exit(main())
