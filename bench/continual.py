"""Forgetting with and without replay (docs/continual.md): pretrain on corpus A, continue on corpus B
from A's weights with A's tokenizer, replay fraction 0 and 0.25, and print each run's loss on A's
validation split (val_loss/replay) and on B's. Runs recipes/continual.toml through `kiln run`'s stages.

    python bench/continual.py [--out runs] [--steps-b 80] [--fractions 0,0.25] [--set KEY=VALUE ...]

--set applies the same dotted overrides to A and to every B (train.seed=1338, train.optimizer=muon).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.pipeline import run_recipe
from kiln.recipe import load_recipe

RECIPE = "recipes/continual.toml"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs")
    p.add_argument("--steps-b", type=int, default=80, help="train.max_steps of the continued runs")
    p.add_argument("--fractions", default="0,0.25")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="dotted overrides for A and B")
    args = p.parse_args()
    print(cpu_line(), flush=True)
    started = time.time()
    a = load_recipe(RECIPE, [f"run.out_dir={args.out}", *args.overrides])
    a_summary = run_recipe(a)["pretrain"]
    rows = [{"run": a.run.name, "fraction": None, "val_loss_A": a_summary["final_val_loss"], "val_loss_B": None}]
    for fraction in (float(f) for f in args.fractions.split(",")):
        b = load_recipe(
            RECIPE,
            [
                f"run.out_dir={args.out}",
                f"run.name=continual-b-{fraction:g}",
                'corpus.sources=["debian_docs"]',
                f"tokenizer.path={a.run_dir / 'tokenizer'}",
                f"train.replay.pack={a.run_dir / 'pack'}",
                f"train.replay.fraction={fraction}",
                f"train.max_steps={args.steps_b}",
                *args.overrides,
            ],
        )
        s = run_recipe(b, init_from=str(a.run_dir / "pretrain"))["pretrain"]
        rows.append(
            {
                "run": b.run.name,
                "fraction": fraction,
                "val_loss_A": s["final_val_loss/replay"],
                "val_loss_B": s["final_val_loss"],
                "replay_sequences": s["replay_sequences"],
            }
        )
    for row in rows:
        print(json.dumps(row))
    print(f"cpu: {os.cpu_count()} cores, {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
