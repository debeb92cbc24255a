"""Held-out task accuracy after each post-training stage of a recipe, over several training seeds,
and the pretrain stage's final validation loss (for recipes that stop at pretraining, such as
tiny-bert and tiny-t5, that is the whole table).

For each seed the script runs the recipe (default `recipes/post-demo.toml`) with `train.seed = SEED`
(it seeds the model's initial weights, the SFT and DPO example order and the GRPO rollouts; the
task problems and the held-out set come from `tasks.seed` and stay the same) into
OUT/seed-SEED/, and reads each post stage's `heldout_before` / `heldout_after` from its stats. With
`--without STAGE` it first runs the chain without that stage (the stages after it start from the
stage before it), then the whole chain, reusing the earlier stages' finished output as `kiln run`
does.

Each finished chain is appended to OUT/results.jsonl, so seeds can run one at a time (the machine
is shared) and the table can be printed from what is there:

    python bench/post_seeds.py --seeds 1337 --without dpo            # one seed (~10 min on 2 cores)
    python bench/post_seeds.py --seeds 1338 1339 --without dpo
    python bench/post_seeds.py --table                               # per-seed table, mean, min-max, std
    python bench/post_seeds.py --seeds 1337 --label beta0.5 --set dpo.beta=0.5   # a DPO setting

There is no peer here: the number is Kiln's own held-out accuracy, stage over stage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.pipeline import run_recipe
from kiln.recipe import POST_STAGES, load_recipe


def run_chain(recipe_path: str, seed: int, out: Path, overrides: list[str], without: str | None) -> dict:
    base = [f"train.seed={seed}", f"run.out_dir={json.dumps(str(out))}", f'run.name="seed-{seed}"', *overrides]
    recipe = load_recipe(recipe_path, base)
    if without:
        stages = [s for s in recipe.run.stages if s != without]
        recipe = load_recipe(recipe_path, [*base, f"run.stages={json.dumps(stages)}"])
    started = time.time()
    results = run_recipe(recipe)
    chain = []
    for stage in (s for s in recipe.run.stages if s in POST_STAGES):
        stats = results[stage]
        chain.append(
            {
                "stage": stage,
                "before": stats["heldout_before"]["accuracy"],
                "after": stats["heldout_after"]["accuracy"],
                "per_task": stats["heldout_after"]["per_task"],
                "preferences": stats.get("heldout_preferences"),
            }
        )
    pretrain = results.get("pretrain") or {}
    return {
        "seconds": round(time.time() - started, 1),
        "pretrain": {k: pretrain.get(k) for k in ("final_val_loss", "final_val_bpb", "train_s")},
        "chain": chain,
    }


def print_table(rows: list[dict]) -> None:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["label"], tuple(s["stage"] for s in row["chain"])), []).append(row)
    for (label, stages), runs in groups.items():
        runs = sorted({r["seed"]: r for r in runs}.values(), key=lambda r: r["seed"])  # latest per seed
        print(f"\n{label}: {' -> '.join(stages)}  ({', '.join(runs[0]['overrides']) or 'recipe as shipped'})")
        print(f"{'seed':>6} " + " ".join(f"{s:>7}" for s in stages) + "   gain per stage")
        gains: dict[str, list[float]] = {s: [] for s in stages}
        afters: dict[str, list[float]] = {s: [] for s in stages}
        for r in runs:
            for s in r["chain"]:
                afters[s["stage"]].append(s["after"])
                gains[s["stage"]].append(s["after"] - s["before"])
            print(
                f"{r['seed']:>6} "
                + " ".join(f"{s['after']:7.2f}" for s in r["chain"])
                + "   "
                + " ".join(f"{s['stage']} {s['after'] - s['before']:+.2f}" for s in r["chain"])
            )
        for name, values in (("accuracy", afters), ("gain", gains)) if stages else ():
            for stat, fn in (
                ("mean", statistics.mean),
                ("min", min),
                ("max", max),
                ("std", lambda v: statistics.stdev(v) if len(v) > 1 else 0.0),
            ):
                sign = "+" if name == "gain" and stat != "std" else ""
                print(f"{name + ' ' + stat:>14} " + " ".join(f"{fn(values[s]):{sign}7.3f}" for s in stages))
        for s in stages:
            raised = sum(g > 0 for g in gains[s])
            print(f"  {s}: raised accuracy over the stage before it in {raised} of {len(gains[s])} seeds")
        print_pretraining(runs)


def loss_text(pretrain: dict) -> str:
    loss = pretrain.get("final_val_loss")
    return "-" if loss is None else f"{loss:.3f}"  # None: a chain without a pretrain stage


def print_pretraining(runs: list[dict]) -> None:
    """The pretrain stage's final validation loss (and bits per byte where the objective has them) and
    training seconds, per seed; rows written before the bench recorded them are left out."""
    runs = [r for r in runs if (r.get("pretrain") or {}).get("final_val_loss") is not None]
    if not runs:
        return
    print(f"{'seed':>6} {'val loss':>9} {'val bpb':>8} {'train s':>8}   (pretrain stage)")
    for r in runs:
        p = r["pretrain"]
        bpb = f"{p['final_val_bpb']:8.3f}" if p.get("final_val_bpb") is not None else f"{'-':>8}"
        print(f"{r['seed']:>6} {p['final_val_loss']:9.3f} {bpb} {p['train_s']:8.0f}")
    losses = [r["pretrain"]["final_val_loss"] for r in runs]
    spread = statistics.stdev(losses) if len(losses) > 1 else 0.0
    print(f"{'mean':>6} {statistics.mean(losses):9.3f}   min {min(losses):.3f} max {max(losses):.3f} std {spread:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/post-demo.toml")
    parser.add_argument("--seeds", type=int, nargs="*", default=[])
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], help="dotted overrides for every run")
    parser.add_argument("--label", default="shipped", help="names this setting in the results")
    parser.add_argument("--without", help="also run the chain without this stage (e.g. dpo)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kiln-post-seeds"))
    parser.add_argument("--table", action="store_true", help="print the table of OUT/results.jsonl")
    args = parser.parse_args()
    print(cpu_line(), flush=True)

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((line for line in lscpu.splitlines() if line.startswith("Model name")), "Model name: ?"))
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    for seed in args.seeds:
        for without in (args.without, None) if args.without else (None,):  # the shorter chain first
            label = args.label if without is None else f"{args.label}, without {without}"
            row = run_chain(args.recipe, seed, args.out, args.overrides, without)
            row |= {
                "label": label,
                "seed": seed,
                "overrides": args.overrides,
                "date": time.strftime("%FT%TZ", time.gmtime()),
            }
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"seed {seed} ({label}) {row['seconds']} s: pretrain val loss {loss_text(row['pretrain'])}; "
                + ", ".join(f"{s['stage']} {s['before']:.2f} -> {s['after']:.2f}" for s in row["chain"])
            )
    if args.table or args.seeds:
        print_table([json.loads(line) for line in results.read_text().splitlines() if line.strip()])


if __name__ == "__main__":
    main()
