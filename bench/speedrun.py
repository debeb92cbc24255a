"""Time to quality (issue 19): Kiln's shipped recipe vs `transformers.Trainer`, same wall-clock budget.

The data is prepared once with recipes/tiny.toml's corpus, tokenizer and pack stages (shrunk by
--bytes-per-source). Then, on that pack:

- Kiln: `kiln.train.trainer.Trainer` with the recipe's [train] section (bf16, train.compile = true),
  stopped by the clock: the bench wraps `Trainer.train_step` and sets the trainer's `stopped_early`
  once --budget-s have passed since fit() was called (the trainer then saves its checkpoint and
  summary as it does at any early stop). Every --snapshot-every steps the weights are copied aside
  (a few ms), with the wall time they were reached at.
- transformers: `transformers.Trainer` (with its default optimizer, torch's AdamW, whatever
  optimizer Kiln's recipe names: the recipe pretrains with Muon, and `--variant
  adamw:train.optimizer=adamw,train.muon_adjust_lr=original` is Kiln with AdamW like for like)
  training a `LlamaForCausalLM` of the same dims (GQA, rope
  theta, norm eps, tied/untied as Kiln, built by bench/train_step.py's `hf_llama`) with the same
  hyperparameters: lr, warmup, cosine decay to the same floor (`cosine_with_min_lr`), weight decay,
  betas, eps, grad clip, micro batch, accumulation, seq len, max_steps (the schedule's length), bf16,
  `torch_compile=True`, and the same token stream (the rows of a Kiln `TokenLoader` with the same
  seed, in order). A callback stops it at the same budget, counted from the `train()` call.
  transformers uses its own AdamW parameter grouping (no decay on norms, decay on embeddings; Kiln
  decays matrices only) and its own loss, which predicts seq_len - 1 tokens of each window
  (labels = input_ids, shifted inside) where Kiln's predicts seq_len.
- With --init-variant (default on): transformers once more, started from Kiln's initial weights, to
  separate the initialisation from the rest.

Every final model, and each Kiln snapshot, is scored by ONE function, `shared_val_bpb`: HF logits
(Kiln's weights converted by `kiln.hf.kiln_to_hf_state`), float32, over the whole validation split
of the pack, bits per byte = total nats / (ln 2 * tokens * bytes_per_token), the same definition
as Kiln's logged val_bpb (tests/bench/test_speedrun.py checks they agree). The time Kiln first
reached transformers' final val bpb is the wall time of the first snapshot that scores at or below
it (snapshot granularity, so an upper bound).

With --variant NAME:KEY=VALUE,KEY=VALUE (repeatable) Kiln also trains once per variant, the
shipped recipe's [train] with those train.* keys changed (Muon, WSD, a shorter schedule...), for the
same budget against the same transformers run: a method measured on its own at equal wall time.

    python bench/speedrun.py                       # 180 s each
    python bench/speedrun.py --budget-s 120 --no-init-variant
    python bench/speedrun.py --variant adamw:train.optimizer=adamw,train.muon_adjust_lr=original
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.data.loader import TokenLoader
from kiln.hf import kiln_to_hf_state
from kiln.model import ModelConfig, count_params
from kiln.pipeline import resolved_model_config, run_recipe, stage_dir
from kiln.recipe import load_recipe
from kiln.train.config import TrainConfig
from kiln.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_line  # bench/ (the script's folder, on sys.path)
from train_step import hf_llama  # noqa: E402  (the bench's identical transformers Llama)

RECIPE = "recipes/tiny.toml"


# ---- the shared evaluation -----------------------------------------------------------------------


def hf_model_from_kiln(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]):
    """A LlamaForCausalLM holding Kiln weights, through Kiln's own exporter's name mapping."""
    model = hf_llama(cfg)
    state = {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}
    missing, unexpected = model.load_state_dict(kiln_to_hf_state(cfg, state), strict=False)
    allowed = {"lm_head.weight"} if cfg.tie_embeddings else set()
    if unexpected or set(missing) - allowed:
        raise RuntimeError(f"weight mapping mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        model.tie_weights()
    return model


@torch.no_grad()
def shared_val_bpb(hf_model, pack_dir, seq_len: int, batch_size: int = 8) -> dict:
    """val_loss (nats/token) and val_bpb over the whole validation split of `pack_dir`, from HF
    logits in float32: one definition for every model compared here."""
    loader = TokenLoader(pack_dir, split="val", seq_len=seq_len, batch_size=batch_size)
    was_training = hf_model.training
    hf_model.eval()
    nats, tokens = 0.0, 0
    for x, y in loader.validation_batches(0, 1):
        logits = hf_model(input_ids=x, use_cache=False).logits.float()
        nats += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        tokens += y.numel()
    hf_model.train(was_training)
    val_loss = nats / tokens
    return {"val_loss": val_loss, "val_bpb": nats / (math.log(2) * tokens * loader.bytes_per_token), "tokens": tokens}


# ---- Kiln, stopped by the clock --------------------------------------------------------------------


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_kiln(model_cfg, train_cfg, pack_dir, out_dir: Path, budget_s: float, snapshot_every: int) -> dict:
    """Kiln's Trainer until budget_s wall seconds from fit(): the loss curve [(step, s, loss)],
    snapshots [(step, s, state_dict)], the initial weights and the final ones."""
    shutil.rmtree(out_dir, ignore_errors=True)
    trainer = Trainer(model_cfg, train_cfg, pack_dir, out_dir)
    initial = clone_state(trainer.model)
    curve, snapshots = [], []
    original_step = trainer.train_step
    start = [0.0]

    def clocked_step(micro_batches, group_norms=False):
        stats = original_step(micro_batches, group_norms=group_norms)
        elapsed = time.perf_counter() - start[0]
        curve.append((trainer.step, elapsed, float(stats["loss"])))
        if trainer.step % snapshot_every == 0:
            snapshots.append((trainer.step, elapsed, clone_state(trainer.model)))
        if elapsed >= budget_s:
            trainer.stopped_early = True  # the loop saves the checkpoint and the summary, then ends
        return stats

    trainer.train_step = clocked_step
    start[0] = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - start[0]
    snapshots.append((trainer.step, curve[-1][1], clone_state(trainer.model)))
    return {"curve": curve, "snapshots": snapshots, "initial": initial, "final": snapshots[-1][2], "wall": wall}


# ---- transformers, stopped by the same clock -------------------------------------------------------


class PackRows(torch.utils.data.IterableDataset):
    """The rows of Kiln's train TokenLoader (same seed, same order) as transformers examples."""

    def __init__(self, pack_dir, seq_len: int, batch_size: int, seed: int):
        self.args = (pack_dir, seq_len, batch_size, seed)

    def __iter__(self):
        pack_dir, seq_len, batch_size, seed = self.args
        for x, _y in TokenLoader(pack_dir, split="train", seq_len=seq_len, batch_size=batch_size, seed=seed):
            for row in x.long():
                yield {"input_ids": row, "labels": row}


def wall_clock_stop(budget_s: float, start: float, clock=time.perf_counter):
    """A transformers TrainerCallback that ends training once `budget_s` seconds have passed since
    `start` (on `clock`), and records [(step, s)] at each step and [(step, s, loss)] at each log."""
    from transformers import TrainerCallback

    class WallClockStop(TrainerCallback):
        def __init__(self):
            self.steps, self.losses = [], []

        def on_step_end(self, args, state, control, **kwargs):
            elapsed = clock() - start
            self.steps.append((state.global_step, elapsed))
            if elapsed >= budget_s:
                control.should_training_stop = True
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append((state.global_step, clock() - start, float(logs["loss"])))

    return WallClockStop()


def hf_arguments(train_cfg: TrainConfig, out_dir: Path, compile: bool):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out_dir),
        max_steps=train_cfg.max_steps,
        per_device_train_batch_size=train_cfg.micro_batch_size,
        gradient_accumulation_steps=train_cfg.global_batch_tokens // (train_cfg.micro_batch_size * train_cfg.seq_len),
        learning_rate=train_cfg.lr,
        warmup_steps=train_cfg.warmup(),
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": train_cfg.min_lr_ratio},
        weight_decay=train_cfg.weight_decay,
        adam_beta1=train_cfg.beta1,
        adam_beta2=train_cfg.beta2,
        adam_epsilon=train_cfg.eps,
        max_grad_norm=train_cfg.grad_clip,
        bf16=train_cfg.precision == "bf16",
        torch_compile=compile,
        logging_steps=10,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=train_cfg.seed,
        use_cpu=True,
    )


def run_hf(model_cfg, train_cfg, pack_dir, out_dir: Path, budget_s: float, initial=None) -> dict:
    from transformers import Trainer as HFTrainer

    shutil.rmtree(out_dir, ignore_errors=True)
    torch.manual_seed(train_cfg.seed)
    model = hf_model_from_kiln(model_cfg, initial) if initial is not None else hf_llama(model_cfg)
    data = PackRows(pack_dir, train_cfg.seq_len, train_cfg.micro_batch_size, train_cfg.seed)
    args = hf_arguments(train_cfg, out_dir, train_cfg.compile)
    start = time.perf_counter()
    stop = wall_clock_stop(budget_s, start)
    trainer = HFTrainer(model=model, args=args, train_dataset=data, callbacks=[stop])
    trainer.train()
    wall = time.perf_counter() - start
    model = getattr(model, "_orig_mod", model)
    return {"steps": stop.steps, "losses": stop.losses, "model": model, "wall": wall}


# ---- report --------------------------------------------------------------------------------------


def steady_tokens_per_s(step_times: list[tuple[int, float]], tokens_per_step: int, skip: int = 5) -> float:
    """Tokens/s between step `skip` and the last: leaves out the compiling first steps."""
    if len(step_times) <= skip + 1:
        return float("nan")
    (s0, t0), (s1, t1) = step_times[skip], step_times[-1]
    return (s1 - s0) * tokens_per_step / (t1 - t0)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME:train.KEY=VALUE,train.KEY=VALUE` -> (NAME, the overrides). Only [train] keys: the
    shared evaluation loads every Kiln model into the same transformers architecture."""
    name, sep, keys = text.partition(":")
    overrides = [k.strip() for k in keys.split(",") if k.strip()]
    if not sep or not name.strip() or not overrides:
        raise SystemExit(f"--variant {text!r}: expected NAME:train.KEY=VALUE[,train.KEY=VALUE...]")
    for key in overrides:
        if not key.startswith("train.") or "=" not in key:
            raise SystemExit(f"--variant {text!r}: {key!r} is not a train.KEY=VALUE override")
    return name.strip(), overrides


def kiln_train_config(base_overrides: list[str], args, extra: list[str] = ()) -> TrainConfig:
    """The recipe's [train] with the bench's flags, then `extra` (a variant's keys, which win)."""
    flags = [f"train.threads={args.threads}"]
    if args.max_steps:
        flags.append(f"train.max_steps={args.max_steps}")
    if args.no_compile:
        flags.append("train.compile=false")
    if args.precision:
        flags.append(f'train.precision="{args.precision}"')
    train_cfg = load_recipe(RECIPE, [*base_overrides, *flags, *extra]).train
    # No validation or periodic checkpoints inside the budget: the shared evaluation scores afterwards.
    return dataclasses.replace(train_cfg, eval_every=train_cfg.max_steps, ckpt_every=train_cfg.max_steps)


def first_reaching(scored: list[tuple[int, float, float]], target: float):
    """The first (step, seconds, bpb) of `scored` at or below `target`, or None."""
    return next((row for row in scored if row[2] <= target), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/kiln-speedrun")
    p.add_argument("--budget-s", type=float, default=180.0, help="wall-clock budget of each training run")
    p.add_argument("--bytes-per-source", type=int, default=2_000_000, help="corpus.max_bytes_per_source")
    p.add_argument("--max-steps", type=int, default=0, help="schedule length for both (0: the recipe's)")
    p.add_argument("--snapshot-every", type=int, default=20, help="Kiln steps between scored snapshots")
    p.add_argument("--no-compile", action="store_true", help="eager for both (compile is the recipe's default)")
    p.add_argument(
        "--precision", choices=["fp32", "bf16"], default="", help="both runs' precision (default: the recipe's)"
    )
    p.add_argument("--no-init-variant", action="store_true", help="skip transformers from Kiln's initial weights")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        help="NAME:train.KEY=VALUE,...: one more Kiln run with these [train] keys (repeatable)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print(f"load average at start: {os.getloadavg()}", flush=True)
    overrides = [f"run.out_dir={args.out}", f"corpus.max_bytes_per_source={args.bytes_per_source}"]
    recipe = load_recipe(RECIPE, overrides)
    run_recipe(recipe, stages=["corpus", "tokenizer", "pack"])
    pack_dir = stage_dir(recipe, "pack")
    model_cfg = resolved_model_config(recipe)
    train_cfg = kiln_train_config(overrides, args)
    variant_cfgs = {name: kiln_train_config(overrides, args, keys) for name, keys in args.variant}
    tokens_per_step = train_cfg.global_batch_tokens
    print(
        f"model: {count_params(model_cfg) / 1e6:.2f}M params, dim {model_cfg.dim}, {model_cfg.n_layers} layers, "
        f"{model_cfg.n_heads} heads / {model_cfg.kv_heads} kv, vocab {model_cfg.vocab_size}; "
        f"train: {train_cfg.optimizer} (transformers: adamw), {tokens_per_step} tokens/step, seq {train_cfg.seq_len}, "
        f"lr {train_cfg.lr}, "
        f"max_steps {train_cfg.max_steps}, {train_cfg.precision}, compile {train_cfg.compile}; "
        f"budget {args.budget_s:.0f} s each",
        flush=True,
    )
    work = Path(args.out) / "speedrun-bench"
    kiln_cfgs = {"kiln": train_cfg, **{f"kiln {name}": cfg for name, cfg in variant_cfgs.items()}}
    kiln_runs = {}
    for name, cfg in kiln_cfgs.items():
        folder = work / name.replace(" ", "-")
        kiln_runs[name] = run_kiln(model_cfg, cfg, pack_dir, folder, args.budget_s, args.snapshot_every)
        print(f"{name}: {kiln_runs[name]['curve'][-1][0]} steps in {kiln_runs[name]['curve'][-1][1]:.0f} s", flush=True)
    runs = {"transformers": run_hf(model_cfg, train_cfg, pack_dir, work / "hf", args.budget_s)}
    print(f"transformers: {runs['transformers']['steps'][-1][0]} steps", flush=True)
    if not args.no_init_variant:
        runs["transformers (Kiln init)"] = run_hf(
            model_cfg, train_cfg, pack_dir, work / "hf-init", args.budget_s, initial=kiln_runs["kiln"]["initial"]
        )
    load_end = os.getloadavg()

    seq = train_cfg.seq_len
    scored = {}  # per Kiln run, its snapshots: (step, s, val bpb)
    rows = {}  # name -> (final val bpb, [(step, s)], tokens per step, [(step, s, loss)])
    for name, kiln in kiln_runs.items():
        scored[name] = [
            (step, seconds, shared_val_bpb(hf_model_from_kiln(model_cfg, state), pack_dir, seq)["val_bpb"])
            for step, seconds, state in kiln["snapshots"]
        ]
        steps = [(s, t) for s, t, _ in kiln["curve"]]
        losses = [(s, t, loss) for s, t, loss in kiln["curve"][9::10]]
        rows[name] = (scored[name][-1][2], steps, kiln_cfgs[name].global_batch_tokens, losses)
    for name, run in runs.items():
        bpb = shared_val_bpb(run["model"], pack_dir, seq)["val_bpb"]
        rows[name] = (bpb, run["steps"], tokens_per_step, run["losses"])

    print(f"\nload average at end: {load_end} (2-core machine shared with other jobs)")
    for name, keys in args.variant:
        print(f"variant kiln {name}: {', '.join(keys)}")
    print("final val bpb (shared evaluation: HF logits, float32, whole validation split):")
    for name, (bpb, steps, tokens, _) in rows.items():
        print(
            f"  {name:26s} val bpb {bpb:.4f}  steps {steps[-1][0]:4d}  "
            f"steady {steady_tokens_per_s(steps, tokens):7.0f} tokens/s  (last step at {steps[-1][1]:.0f} s)"
        )
    hf_bpb, hf_steps = rows["transformers"][0], rows["transformers"][1]
    hf_rate = steady_tokens_per_s(hf_steps, tokens_per_step)
    for name in kiln_runs:
        print(
            f"{name} snapshots (step, s, val bpb): " + ", ".join(f"({s}, {t:.0f}, {b:.3f})" for s, t, b in scored[name])
        )
        hit = first_reaching(scored[name], hf_bpb)
        if hit is None:
            print(f"{name} did not reach transformers' final val bpb {hf_bpb:.4f} within the budget")
        else:
            print(
                f"{name} first reached transformers' final val bpb {hf_bpb:.4f} at step {hit[0]}, {hit[1]:.0f} s "
                f"= {hit[1] / args.budget_s:.2f} of the {args.budget_s:.0f} s budget (snapshot every "
                f"{args.snapshot_every} steps: an upper bound)"
            )
        rate = steady_tokens_per_s(rows[name][1], rows[name][2])
        print(f"steady tokens/s ratio {name}/transformers: {rate / hf_rate:.2f}x")
    curves = {name: losses for name, (_, _, _, losses) in rows.items()}
    (work / "curves.json").write_text(json.dumps({"curves": curves, "kiln_snapshots": scored}, indent=1))
    print(f"loss/time curves: {work / 'curves.json'}")


if __name__ == "__main__":
    main()
