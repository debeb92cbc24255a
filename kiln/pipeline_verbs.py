"""The verbs that read a recipe: `kiln run`, one verb per stage (corpus ... distill), and `kiln
launch` and `kiln plan`, whose recipe is read here. A recipe is the top layer's (kiln/recipe.py), so
kiln.parallel gets the typed sections it needs from these verbs and keeps the rest of launch and
plan. kiln/cli.py lists them; the stages themselves run in kiln.pipeline (docs/pipeline.md)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from kiln import run_store
from kiln.config import RECIPE_HELP
from kiln.errors import ConfigError, DataError, did_you_mean
from kiln.model.config import arch_of
from kiln.parallel.dims import check_job_options, init_distributed
from kiln.parallel.launch import add_launch_parser, run_launch
from kiln.parallel.plan import Workload
from kiln.parallel.plan_cli import add_plan_parser, run_plan
from kiln.pipeline import rank_and_world, run_recipe, stage_dir
from kiln.recipe import POST_STAGES, STAGES, Recipe, load_recipe
from kiln.recipe_files import resolve_recipe
from kiln.stage_summary import next_command

POST_VERBS = {
    "sft": "supervised fine-tuning on conversations and the verifiable tasks",
    "rm": "reward model: the transformer with a scalar head, Bradley-Terry on pairs",
    "dpo": "direct preference optimisation (sigmoid, IPO or conservative DPO)",
    "ppo": "PPO: actor, critic, frozen reference, verifier or reward-model reward",
    "grpo": "group-relative policy optimisation with the task verifiers as rewards",
    "distill": "distillation from a teacher checkpoint: generated data and soft targets",
}


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", default="tiny", help=RECIPE_HELP)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 model.n_layers=6")
    p.add_argument("--force", action="store_true", help="rebuild even if the stage is already done")


def add_parser(subparsers) -> None:
    """Registers run, corpus, data, tokenizer, pack, pretrain, the post-training verbs, launch and plan."""
    p = subparsers.add_parser("run", help="run the stages a recipe names, skipping finished ones")
    _recipe_args(p)
    p.add_argument("--stages", help="comma-separated subset of stages to run")
    _recipe_args(subparsers.add_parser("corpus", help="build the built-in corpus of real text"))
    _recipe_args(
        subparsers.add_parser("data", help="curate documents: filter, deduplicate, scrub (runs the data stage)")
    )
    p = subparsers.add_parser("tokenizer", help="train a tokenizer (byte-level BPE, or unigram with tokenizer.model)")
    tok = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    _recipe_args(tok.add_parser("train", help="train on the run's corpus"))
    _recipe_args(subparsers.add_parser("pack", help="tokenize the corpus into memory-mapped token shards"))
    p = subparsers.add_parser("pretrain", help="pretrain the model on the packed shards")
    _recipe_args(p)
    p.add_argument("--resume", default="auto", help="auto (newest complete checkpoint), none, or a checkpoint path")
    p.add_argument("--init-from", help="start a new run from this checkpoint's weights")
    for verb, what in POST_VERBS.items():
        p = subparsers.add_parser(verb, help=what)
        _recipe_args(p)
        p.add_argument("--resume", default="auto", help="auto (newest complete checkpoint), none, or a path")
        p.add_argument("--init-from", help="start from this checkpoint instead of the previous stage's")
    add_launch_parser(subparsers)
    add_plan_parser(subparsers)


def run(args: argparse.Namespace) -> int:
    """The verb add_parser registered as args.verb; a stage verb is named after its stage."""
    if args.verb == "launch":
        # The whole recipe is validated before a job is submitted; a path that exists only on the
        # cluster is passed through.
        parallel = load_recipe(args.recipe, args.overrides).parallel if resolve_recipe(args.recipe).is_file() else None
        return run_launch(args, parallel)
    if args.verb == "plan":
        return run_plan(args, _plan_shape(args) if args.recipe else None)
    recipe = load_recipe(args.recipe, args.overrides)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Started by torchrun (directly, or through `kiln launch`, Slurm or Kubernetes): join the job,
        # over gloo when train.device = "cpu" (the trainer then stays on the CPU), else NCCL on a GPU.
        import torch

        on_gpu = recipe.train.device != "cpu" and torch.cuda.is_available()
        init_distributed("cuda" if on_gpu else "cpu")
    if args.verb == "run":
        _run_all(recipe, args)
    else:
        _run_stage(recipe, args)
    return 0


PLANNED_PRECISIONS = ("auto", "bf16", "fp16")


def _plan_shape(args: argparse.Namespace):
    """(model with its vocab_size, else the tokenizer's, and the [train] workload) of the plan's recipe."""
    recipe = load_recipe(args.recipe, args.overrides)
    if arch_of(recipe.model) != "decoder":
        raise ConfigError(
            "model.arch",
            f'`kiln plan` lays out decoder models; [model] arch = "{arch_of(recipe.model)}" has no plan yet',
        )
    if recipe.train.precision not in PLANNED_PRECISIONS:
        # The planner's activation bytes, autocast copies and matmul peaks are 16-bit ones (docs/plan.md).
        raise ConfigError(
            "train.precision",
            f"`kiln plan` models 16-bit autocast ({', '.join(PLANNED_PRECISIONS)}; auto is bf16 on a GPU), "
            f"not {recipe.train.precision!r}; plan with train.precision=auto",
        )
    model = dataclasses.replace(recipe.model, vocab_size=recipe.model.vocab_size or recipe.tokenizer.vocab_size)
    train = recipe.train
    return model, Workload(train.seq_len, train.global_batch_tokens, train.optimizer, train.muon_ns_steps)


def _check_training_layout(recipe: Recipe, stages: list[str]) -> None:
    post = [s for s in stages if s in POST_STAGES]
    if post and arch_of(recipe.model) != "decoder":
        raise ConfigError(
            "run.stages",
            f'{", ".join(post)} post-train decoder models; [model] arch = "{arch_of(recipe.model)}" pretrains only',
        )
    if any(s == "pretrain" or s in POST_STAGES for s in stages):  # torch only for a training run
        check_job_options(recipe.parallel)


def parse_stages(text: str | None) -> list[str] | None:
    """The stages of `--stages a,b`, each one a stage Kiln knows (else one ConfigError naming it)."""
    if not text:
        return None
    stages = [s.strip() for s in text.split(",") if s.strip()]
    for name in stages:
        if name not in STAGES:
            raise ConfigError(
                "--stages",
                f"unknown stage {name!r}{did_you_mean(name, STAGES)}; the stages are {', '.join(STAGES)}",
                "<command line>",
            )
    if not stages:
        raise ConfigError("--stages", f"names no stage; the stages are {', '.join(STAGES)}", "<command line>")
    return stages


def check_resume(resume: str) -> None:
    """`--resume PATH` names a readable checkpoint: checked before any stage runs, so a typo costs
    nothing (auto and none need no check)."""
    if resume in ("auto", "none"):
        return
    from kiln.checkpoint import read_manifest, resolve_checkpoint  # lazy: torch, for model stages only

    try:
        read_manifest(resolve_checkpoint(resume))
    except DataError as e:
        raise ConfigError("--resume", str(e), "<command line>") from None


def _run_all(recipe: Recipe, args: argparse.Namespace) -> None:
    stages = parse_stages(args.stages)
    _check_training_layout(recipe, stages or recipe.run.stages)
    results = run_recipe(recipe, stages, force=args.force)
    print(f"run folder: {run_store.remote_run(recipe) or run_store.local_run_dir(recipe)}")
    ran = [s for s in STAGES if s in results]
    if ran and rank_and_world()[0] == 0:
        last = ran[-1]
        print(
            next_command(
                last, recipe.run.stages, args.recipe, stage_dir(recipe, last), recipe.sample.prompt, results[last]
            )
        )


def _run_stage(recipe: Recipe, args: argparse.Namespace) -> None:
    extra = {"resume": args.resume, "init_from": args.init_from} if hasattr(args, "init_from") else {}
    target = args.verb
    _check_training_layout(recipe, [target])
    if extra:
        check_resume(args.resume)
    # Unfinished upstream stages of the recipe run first (finished ones are skipped), so any verb
    # works on a fresh run folder. Curating explicit inputs needs no corpus.
    upstream = [s for s in recipe.run.stages if STAGES.index(s) < STAGES.index(target)]
    if target == "data" and recipe.data.inputs:
        upstream = []
    if upstream:
        run_recipe(recipe, upstream)
    run_recipe(recipe, [target], force=args.force, **extra)
    if rank_and_world()[0] == 0:
        print(next_command(target, recipe.run.stages, args.recipe, stage_dir(recipe, target), recipe.sample.prompt))
