"""How closely fp8 training (train.precision = "fp8", torchao Float8Linear) follows bf16 on CPU: the
tiny model and data of tests/train/test_fp8.py trained from one seed in fp32, bf16 and fp8
(tensorwise, rowwise) through Kiln's Trainer, printing each run's per-step losses, the largest
per-step gap to bf16, the final validation loss and the wall time. docs/fp8.md records a run.

    python bench/fp8_band.py                 # 30 steps, lr 3e-3 (the slow test's setting)
    python bench/fp8_band.py --steps 12 --lr 1e-2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the checkout's kiln, and the tests' tiny pack and config

from kiln_testing.train import make_tiny_pack, tiny_train_config  # noqa: E402
from machine import cpu_line  # noqa: E402  (bench/, the script's folder, is on sys.path)

from kiln.model import ModelConfig  # noqa: E402
from kiln.train.trainer import Trainer  # noqa: E402

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, vocab_size=64)
RUNS = (("fp32", ""), ("bf16", ""), ("fp8", "tensorwise"), ("fp8", "rowwise"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="fp8_band-"))
    pack = make_tiny_pack(root / "pack")
    results = {}
    for precision, recipe in RUNS:
        name = f"{precision} {recipe}".strip()
        out = root / name.replace(" ", "-")
        cfg = tiny_train_config(
            precision=precision, fp8_recipe=recipe, max_steps=args.steps, lr=args.lr, eval_every=10**6, ckpt_every=10**6
        )
        started = time.perf_counter()
        summary = Trainer(MODEL, cfg, pack, out).fit()
        records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        losses = [r["loss"] for r in records if r["kind"] == "train"]
        results[name] = (losses, summary, time.perf_counter() - started)
    bf16 = results["bf16"][0]
    print(
        f"\n{args.steps} steps at lr {args.lr}; model dim {MODEL.dim}, {MODEL.n_layers} layers, vocab {MODEL.vocab_size}"
    )
    print("| run | fp8 linears | max per-step gap to bf16 (nats) | final val loss | wall s |")
    print("|---|---|---|---|---|")
    for name, (losses, summary, wall) in results.items():
        gap = max(abs(a - b) for a, b in zip(losses, bf16))
        print(f"| {name} | {summary['fp8_linears']} | {gap:.4f} | {summary['final_val_loss']:.4f} | {wall:.1f} |")
    for name, (losses, _, _) in results.items():
        print(name, " ".join(f"{v:.4f}" for v in losses))


if __name__ == "__main__":
    main()
