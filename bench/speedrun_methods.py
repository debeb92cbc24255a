"""Training-efficiency methods one at a time (issue 19): the same tiny model, data and token budget,
trained with the baseline (AdamW, cosine schedule, untied embeddings, no QK-norm) and with one method
switched on per run: train.optimizer = "muon" (torch.optim.Muon on the block matrices, AdamW on the
rest), model.qk_norm, model.tie_embeddings, train.schedule = "wsd", train.seq_len_warmup_steps;
prints each run's final validation loss. (train.batch_ramp_* is not a variant here: the bench's
batch is one micro-batch, the ramp's unit.) Data: recipes/tiny.toml's corpus, tokenizer and pack
stages, shrunk by the overrides below.

    python bench/speedrun_methods.py [--out /tmp/speedrun] [--steps 100] [--seed 1337]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.pipeline import resolved_model_config, run_recipe, stage_dir
from kiln.recipe import load_recipe
from kiln.train.trainer import Trainer

RECIPE = "recipes/tiny.toml"
DATA = ["corpus.max_bytes_per_source=1000000", "tokenizer.vocab_size=4096"]
# Each variant changes only its own keys ("model.x" in the model config, the rest in train); lr is
# AdamW's (embeddings, head and norms under Muon too).
VARIANTS = {
    "adamw": {},
    "muon": {"optimizer": "muon"},  # muon_lr 0.02, "original" shape scaling
    "muon-match-rms": {"optimizer": "muon", "muon_adjust_lr": "match_rms_adamw"},  # muon_lr = lr
    "qk-norm": {"model.qk_norm": True},
    "tied": {"model.tie_embeddings": True},  # the baseline is untied
    "wsd": {"schedule": "wsd"},  # decay_fraction 0.2: flat after warmup, 1 - sqrt to the floor over the last 20 steps
    # Windows of 32 tokens for the first 10 steps, 64 until step 30, then the bench's full 128.
    "seq-warmup": {"seq_len_warmup_steps": 30, "seq_len_start": 32},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/speedrun")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    started = time.time()
    recipe = load_recipe(RECIPE, [f"run.out_dir={args.out}", *DATA])
    run_recipe(recipe, stages=["corpus", "tokenizer", "pack"])
    train = dataclasses.replace(
        recipe.train,
        # The baseline is AdamW: the tiny recipe pretrains with Muon (since 2026-12-07), and each
        # variant below switches on one method over this baseline.
        optimizer="adamw",
        muon_adjust_lr="original",
        seq_len=128,
        micro_batch_size=8,
        global_batch_tokens=1024,
        max_steps=args.steps,
        warmup_steps=10,
        eval_every=args.steps,
        ckpt_every=args.steps,
        compile=False,
        precision="fp32",
        seed=args.seed,
        threads=2,  # the machine's share; more threads than cores only contend
    )
    # Small enough for a few minutes on 2 shared cores: 2 blocks of width 128, vocabulary from the pack.
    model = dataclasses.replace(resolved_model_config(recipe), dim=128, n_layers=2, n_heads=4, n_kv_heads=4)
    for name in args.variants.split(","):
        keys = VARIANTS[name]
        model_keys = {k.removeprefix("model."): v for k, v in keys.items() if k.startswith("model.")}
        cfg = dataclasses.replace(train, **{k: v for k, v in keys.items() if not k.startswith("model.")})
        t0 = time.time()
        out = stage_dir(recipe, "pretrain").parent / f"speedrun-{name}-s{args.seed}"
        summary = Trainer(dataclasses.replace(model, **model_keys), cfg, stage_dir(recipe, "pack"), out).fit()
        row = {"variant": name, "steps": args.steps, "tokens": args.steps * cfg.global_batch_tokens}
        row |= {"final_val_loss": round(summary["final_val_loss"], 4), "seconds": round(time.time() - t0)}
        print(json.dumps(row), flush=True)
    print(f"{cpu_line()}; seed {args.seed}, {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
