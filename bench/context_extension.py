"""Context extension at CPU scale: validation loss at 4x the pretraining length, before and after
continued pretraining with scaled RoPE (recipes/context-extension.toml, docs/long_context.md).

A small model pretrains at --short tokens (recipes/tiny.toml, shrunk by SMALL); then, from its
checkpoint, recipes/context-extension.toml continues at 4x that length with the --type scaling.
Printed: val loss over windows of the long length for the base checkpoint with plain RoPE (the
positions past its context are unseen), with the scaled RoPE before any training, and after.

    python bench/context_extension.py
    python bench/context_extension.py --type linear --long-steps 200
    python bench/context_extension.py --set train.optimizer=muon train.muon_adjust_lr=match_rms_adamw \
        --extend-set train.optimizer=adamw train.muon_adjust_lr=original

--set applies dotted overrides to every run (the base, the extension and the control; after SMALL, so
they win over it); --extend-set only to the extension and the control that matches it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.model.config import RopeScaling
from kiln.pipeline import resolved_model_config, run_recipe, stage_dir
from kiln.recipe import load_recipe
from kiln.train.trainer import Trainer

# Data and model of both runs: a ~0.2M-parameter model on ~3 MB of the tiny recipe's text, small
# enough for a shared 2-core CPU.
SMALL = [
    "corpus.max_bytes_per_source=1000000",
    "tokenizer.vocab_size=1024",
    'model.preset=""',
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    'train.precision="fp32"',
    "train.compile=false",
    "train.micro_batch_size=8",
    # AdamW, as measured in docs/benchmarks.md (the tiny recipe pretrains with Muon since 2026-12-07).
    "train.optimizer=adamw",
    "train.muon_adjust_lr=original",
]


def evaluate(recipe, model_cfg, init_from, out: Path) -> float:
    """val loss of init_from's weights in `model_cfg` over recipe's validation windows."""
    trainer = Trainer(model_cfg, recipe.train, stage_dir(recipe, "pack"), out, init_from=init_from)
    return trainer.evaluate()["val_loss"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--type", default="yarn", choices=["linear", "dynamic", "yarn", "llama3"])
    p.add_argument("--short", type=int, default=32, help="pretraining sequence length")
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--long-steps", type=int, default=100)
    p.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="dotted overrides for every run")
    p.add_argument("--extend-set", nargs="*", default=[], help="dotted overrides for the extension and its control")
    return p.parse_args(argv)


def recipes(args: argparse.Namespace, out: Path):
    """(base, extension) recipes: the base at --short tokens, the extension at 4x with --type scaling;
    --set over both, --extend-set over the extension (and so over the control built from it)."""
    short, long = args.short, 4 * args.short
    common = [*SMALL, *args.overrides, f'run.out_dir="{out}"']
    base = load_recipe(
        "recipes/tiny.toml",
        [
            *common,
            'run.stages=["corpus", "tokenizer", "pack", "pretrain"]',
            f"model.max_seq_len={short}",
            f"train.seq_len={short}",
            f"train.global_batch_tokens={16 * short}",
            f"train.max_steps={args.base_steps}",
            f"train.eval_every={args.base_steps}",
            f"train.ckpt_every={args.base_steps}",
        ],
    )
    scaling = {"type": args.type, "factor": 4.0}
    if args.type != "linear":
        scaling["original_max_seq_len"] = short
    table = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in scaling.items()) + "}"
    extended = load_recipe(
        "recipes/context-extension.toml",
        [
            *common,
            f"model.max_seq_len={long}",
            f"model.rope_scaling={table}",
            f"train.seq_len={long}",
            "train.micro_batch_size=4",
            f"train.global_batch_tokens={4 * long}",
            f"train.max_steps={args.long_steps}",
            f"train.eval_every={args.long_steps}",
            f"train.ckpt_every={args.long_steps}",
            "train.warmup_steps=10",
            *args.extend_set,
        ],
    )
    return base, extended


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Row name -> val loss, in the order printed."""
    out = Path(args.out or tempfile.mkdtemp(prefix="kiln-ctx-"))
    short, long = args.short, 4 * args.short
    started = time.time()
    base, extended = recipes(args, out)
    base_stats = run_recipe(base)["pretrain"]
    checkpoint = stage_dir(base, "pretrain") / "checkpoints"
    run_recipe(extended, ["corpus", "tokenizer", "pack"])
    model_cfg = resolved_model_config(extended)
    plain = dataclasses.replace(model_cfg, rope_scaling=None)
    rows = {
        f"base, its own length {short}": base_stats["final_val_loss"],
        f"base at {long}, plain RoPE": evaluate(extended, plain, checkpoint, out / "eval-plain"),
        f"base at {long}, {args.type} RoPE, no training": evaluate(
            extended, model_cfg, checkpoint, out / "eval-scaled"
        ),
    }
    after = run_recipe(extended, ["pretrain"], init_from=str(checkpoint))["pretrain"]
    rows[f"after {args.long_steps} steps at {long}, {args.type} RoPE"] = after["final_val_loss"]
    # The control: as many more tokens at the short length, so that the gain above is not just
    # more training. Same tokens per step (16 x short = 4 x long), rate and warmup as the extension.
    more = dataclasses.replace(
        base,
        run=dataclasses.replace(base.run, name="tiny-more"),
        train=dataclasses.replace(extended.train, seq_len=short, micro_batch_size=8, global_batch_tokens=16 * short),
    )
    run_recipe(more, init_from=str(checkpoint))
    more_ckpt = stage_dir(more, "pretrain") / "checkpoints"
    rows[f"control: {args.long_steps} more steps at {short}, evaluated at {long}, plain RoPE"] = evaluate(
        extended, plain, more_ckpt, out / "eval-more-plain"
    )
    rows[f"control, evaluated at {long} with {args.type} RoPE"] = evaluate(
        extended, model_cfg, more_ckpt, out / "eval-more-scaled"
    )
    assert isinstance(model_cfg.rope_scaling, RopeScaling)
    print(f"\n{args.type} x4, {short} -> {long} tokens ({time.time() - started:.0f} s, run folder {out})")
    return rows


def main() -> None:
    print(cpu_line(), flush=True)
    rows = measure(parse_args())
    print("| model | val loss |\n| --- | --- |")
    for name, loss in rows.items():
        print(f"| {name} | {loss:.3f} |")


if __name__ == "__main__":
    main()
