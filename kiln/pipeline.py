"""`kiln run`: the stages a recipe names, in order, each into runs/<name>/<stage>/.

A finished stage leaves a DONE marker holding a fingerprint of every config section that shaped
its output (its own and its upstream stages'; for a post-training stage, also which post stages
precede it in run.stages) and those sections themselves. A rerun skips a stage
whose marker matches; a stage whose inputs changed is rebuilt, and so, through the fingerprints, is
everything downstream of it. A training stage's earlier output is never deleted: it moves to
<stage>.previous-N. Pretraining without a marker resumes from its newest complete checkpoint, and
so does a finished pretraining whose only change is a larger train.max_steps (extending the run).
With run.out_dir on an object store (s3://), the stages run in local staging copies and are
published with DONE last (kiln/run_store.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from kiln import run_store, storage
from kiln.config import RECIPE_HELP
from kiln.data.corpus import build_corpus
from kiln.data.curate import curate
from kiln.data.pack import pack
from kiln.data.slurm_executor import SLURM_DIR
from kiln.data.tokenizer import Tokenizer, train_tokenizer_from_corpus
from kiln.data.warc_demo import ensure_demo_crawl
from kiln.errors import ConfigError, DataError, did_you_mean
from kiln.files import write_text_atomic
from kiln.model.config import arch_of
from kiln.parallel.dims import check_job_options, init_distributed
from kiln.parallel.launch import add_launch_parser, run_launch
from kiln.parallel.plan import Workload
from kiln.parallel.plan_cli import add_plan_parser, run_plan
from kiln.recipe import POST_STAGES, STAGES, Recipe, export_source, load_recipe, recipe_to_dict
from kiln.recipe_files import resolve_recipe
from kiln.run_store import MARKER
from kiln.stage_summary import loadable, model_output, next_command, stage_lines
from kiln.train.schedule import lr_at

# Which recipe sections determine each stage's output, upstream included.
STAGE_INPUTS = {
    "corpus": ("corpus",),
    "data": ("corpus", "data"),
    "tokenizer": ("corpus", "data", "tokenizer"),
    "pack": ("corpus", "data", "tokenizer", "pack"),
    "pretrain": ("corpus", "data", "tokenizer", "pack", "model", "train"),
    "sample": ("corpus", "data", "tokenizer", "pack", "model", "train", "sample"),
    # A post-training stage starts from the one before it, so it depends on all of their tables.
    **{
        stage: (
            "corpus",
            "data",
            "tokenizer",
            "pack",
            "model",
            "train",
            "tasks",
            "peft",
            *POST_STAGES[: POST_STAGES.index(stage) + 1],
        )
        for stage in POST_STAGES
    },
}
RESUMABLE = ("pretrain", *POST_STAGES)  # stages that continue from their own checkpoints
# The one key whose increase continues a finished stage from its checkpoints instead of starting
# it again: the steps already taken are the steps the longer run takes first.
EXTENDS = {"pretrain": "train.max_steps"}
EXTENSIONS_LOG = "extensions.jsonl"  # the DONE markers an extended stage had, oldest first


def _input_names(recipe: Recipe, stage: str) -> tuple[str, ...]:
    # The export stage is shaped by the stage it exports (and everything upstream of that) and [export].
    if stage == "export":
        return (*STAGE_INPUTS[export_source(recipe)], "export")
    return STAGE_INPUTS[stage]


def _sections(recipe: Recipe, stage: str) -> dict:
    # The data section shapes downstream output only when the run curates its corpus.
    names = [n for n in _input_names(recipe, stage) if n != "data" or "data" in recipe.run.stages]
    sections = {name: dataclasses.asdict(getattr(recipe, name)) for name in names}
    shaped_by = export_source(recipe) if stage == "export" else stage
    if shaped_by in POST_STAGES:
        # A post stage starts from the one before it in run.stages: dropping or adding an earlier
        # stage changes its starting weights although no section it reads has changed.
        earlier = [s for s in POST_STAGES[: POST_STAGES.index(shaped_by)] if s in recipe.run.stages]
        sections["chain"] = {"stages_before": earlier}
    return sections


def stage_inputs(recipe: Recipe, stage: str) -> dict:
    """The config sections that shape the stage's output, as the JSON its DONE marker records."""
    return json.loads(json.dumps(_sections(recipe, stage), default=str))


def fingerprint(recipe: Recipe, stage: str) -> str:
    return hashlib.sha256(json.dumps(_sections(recipe, stage), sort_keys=True).encode()).hexdigest()[:16]


def changed_keys(before: dict, after: dict, prefix: str = "") -> dict[str, tuple]:
    """Dotted key -> (before, after) for every leaf value that differs."""
    out = {}
    for key in sorted(set(before) | set(after), key=str):
        old, new = before.get(key), after.get(key)
        name = f"{prefix}{key}"
        if isinstance(old, dict) and isinstance(new, dict):
            out.update(changed_keys(old, new, name + "."))
        elif old != new:
            out[name] = (old, new)
    return out


def _reason(changes: dict[str, tuple] | None, force: bool) -> str:
    if force:
        return "rerun by --force"
    if changes is None:
        return "inputs changed (its DONE marker does not record which)"
    return "inputs changed (" + "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()) + ")"


def stage_dir(recipe: Recipe, stage: str) -> Path:
    """The stage's local folder (the staging copy of a stage on an object store)."""
    return run_store.local_run_dir(recipe) / stage


def is_done(recipe: Recipe, stage: str) -> bool:
    text = run_store.read_marker(recipe, stage)
    if text is None:
        return False
    try:
        return json.loads(text)["fingerprint"] == fingerprint(recipe, stage)
    except (ValueError, KeyError, TypeError):
        return False


def _inputs_of(recipe: Recipe, stage: str) -> list[str]:
    """The earlier stages whose folders the stage reads."""
    docs = "data" if "data" in recipe.run.stages else "corpus"
    needs = {"data": ["corpus"], "tokenizer": [docs], "pack": [docs, "tokenizer"], "pretrain": ["pack", "tokenizer"]}
    return needs.get(stage, ["tokenizer"] if stage == "sample" else [])


def run_recipe(
    recipe: Recipe,
    stages: list[str] | None = None,
    force: bool = False,
    resume: str = "auto",
    init_from: str | None = None,
) -> dict[str, Any]:
    """Run ``stages`` (default: the recipe's) in pipeline order; return each stage's stats."""
    wanted = stages if stages is not None else recipe.run.stages
    results: dict[str, Any] = {}
    # Under torchrun every rank runs this function; only pretraining needs them all. Rank 0 runs the
    # other stages and owns the run folder's files while the other ranks wait at a barrier.
    rank, world = _rank_and_world()
    run_store.check_stages(recipe, wanted)
    if rank == 0:
        run_dir = run_store.local_run_dir(recipe)
        run_dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(recipe_to_dict(recipe), indent=2)
        write_text_atomic(run_dir / "recipe.json", text)
        run_store.write_recipe(recipe, text)
    for stage in (s for s in STAGES if s in wanted):
        out = stage_dir(recipe, stage)
        marker = out / MARKER
        if not force and is_done(recipe, stage):
            if rank == 0:
                print(f"[{stage}] done already in {run_store.published(recipe, stage)}, skipping")
            results[stage] = json.loads(run_store.read_marker(recipe, stage)).get("stats", {})
            continue
        if rank == 0:
            _prepare_stage_dir(recipe, stage, force)
            where = run_store.published(recipe, stage)
            print(f"[{stage}] -> {where}" + (f" (staged in {out})" if where != out else ""))
        _barrier(world)
        for upstream in _inputs_of(recipe, stage):
            run_store.fetch_stage(recipe, upstream)  # a stage published on the store: its local copy
        started = time.time()
        stats = None
        if rank == 0 or stage in RESUMABLE:
            stats = STAGE_RUNNERS[stage](recipe, out, resume=resume, init_from=init_from)
        seconds = round(time.time() - started, 1)
        if stage == "data" and stats is None:
            # Submitted to Slurm (or a dry run): not done; the same command again, once the jobs
            # ended, finds every task done and finishes the stage (or resubmits what failed).
            print(f"[{stage}] on Slurm: run this command again once the jobs have finished")
            return results
        if rank == 0:
            print(f"[{stage}] finished in {seconds} s")
            for line in stage_lines(stage, out, stats):
                print(line)
            if not (out / "stats.json").exists():
                write_text_atomic(out / "stats.json", json.dumps(stats, indent=2, default=str))
            # Atomic: a kill mid-write must not leave an unreadable marker, which the next run would
            # take for stale output.
            done = {
                "fingerprint": fingerprint(recipe, stage),
                "inputs": stage_inputs(recipe, stage),
                "seconds": seconds,
                "stats": stats,
            }
            write_text_atomic(marker, json.dumps(done, indent=2, default=str))
            run_store.publish_stage(recipe, stage)  # on an object store: every file, then DONE
        _barrier(world)
        results[stage] = (
            stats if stats is not None else json.loads(run_store.read_marker(recipe, stage)).get("stats", {})
        )
    return results


def _prepare_stage_dir(recipe: Recipe, stage: str, force: bool) -> None:
    """Make the stage's folder ready to run into: an extended stage keeps its folder (and resumes),
    a stale training stage moves to <stage>.previous-N, other stale or partial output is removed."""
    out = stage_dir(recipe, stage)
    marker_text = run_store.read_marker(recipe, stage)
    if stage == "data" and not force and marker_text is None and (out / "work" / SLURM_DIR).is_dir():
        print(f"[{stage}] continuing the Slurm run in {out}")  # its finished tasks are kept
        return
    if run_store.stage_exists(recipe, stage) and (marker_text is not None or stage not in RESUMABLE or force):
        changes = _marker_changes(recipe, stage) if marker_text is not None else None
        if not force and changes is not None and _extends(stage, changes):
            key = EXTENDS[stage]
            old, new = changes[key]
            print(f"[{stage}] extending the run: {key}: {old} -> {new}; resuming from its newest checkpoint")
            _print_schedule_change(recipe, old)
            run_store.fetch_stage(recipe, stage)  # its metrics and logs continue in the staging copy
            with open(out / EXTENSIONS_LOG, "a") as f:
                f.write(json.dumps(json.loads(marker_text)) + "\n")
            run_store.unpublish(recipe, stage)
            (out / "stats.json").unlink(missing_ok=True)
        elif stage in RESUMABLE:
            # Checkpoints cost compute to remake: every earlier output of a training stage is kept.
            previous = run_store.move_to_previous(recipe, stage)
            print(f"[{stage}] {_reason(changes, force)}; earlier output kept in {previous}")
        else:  # stale or partial output of a stage that cannot resume: rebuild from scratch
            if marker_text is not None:
                print(f"[{stage}] {_reason(changes, force)}; rebuilding")
            run_store.remove_stage(recipe, stage)
    out.mkdir(parents=True, exist_ok=True)


def _marker_changes(recipe: Recipe, stage: str) -> dict[str, tuple] | None:
    try:
        recorded = json.loads(run_store.read_marker(recipe, stage) or "").get("inputs")
    except (ValueError, AttributeError):
        return None
    return changed_keys(recorded, stage_inputs(recipe, stage)) if isinstance(recorded, dict) else None


def _extends(stage: str, changes: dict[str, tuple]) -> bool:
    key = EXTENDS.get(stage)
    if key is None or set(changes) != {key}:
        return False
    old, new = changes[key]
    return isinstance(old, int) and isinstance(new, int) and new > old


def _print_schedule_change(recipe: Recipe, old_steps: int) -> None:
    """The learning rate is a function of the step and max_steps, so a longer run continues on the
    longer schedule: say where that puts the first extended step."""
    before = lr_at(old_steps - 1, dataclasses.replace(recipe.train, max_steps=old_steps))
    after = lr_at(old_steps, recipe.train)
    print(
        f"[pretrain] the {recipe.train.schedule} schedule now spans {recipe.train.max_steps} steps: step "
        f"{old_steps} trains at lr {after:.3g} (the {old_steps}-step run ended at {before:.3g})"
    )


def _rank_and_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _corpus(recipe: Recipe, out: Path, **_) -> dict:
    return build_corpus(recipe.corpus, out)


def documents_dir(recipe: Recipe) -> Path:
    """Where the tokenizer and packer read documents: the curated ones when the run curates."""
    if "data" in recipe.run.stages:
        return stage_dir(recipe, "data") / "docs"
    return stage_dir(recipe, "corpus")


def _data(recipe: Recipe, out: Path, **_) -> dict:
    if recipe.data.demo_crawl:
        ensure_demo_crawl(Path(recipe.data.inputs[0]))
    return curate(recipe.data, out, default_inputs=sorted(stage_dir(recipe, "corpus").glob("*.jsonl")))


def _tokenizer(recipe: Recipe, out: Path, **_) -> dict:
    stats = train_tokenizer_from_corpus(documents_dir(recipe), recipe.tokenizer, out)
    print(f"[tokenizer] held-out compression: {stats['bytes_per_token']:.2f} bytes/token")
    return stats


def _pack(recipe: Recipe, out: Path, **_) -> dict:
    return pack(documents_dir(recipe), stage_dir(recipe, "tokenizer") / "tokenizer.json", recipe.pack, out)


def resolved_model_config(recipe: Recipe):
    """The model config with ``vocab_size = 0`` replaced by the packed data's vocabulary size."""
    if recipe.model.vocab_size:
        return recipe.model
    mixture = json.loads((stage_dir(recipe, "pack") / "mixture.json").read_text())
    return dataclasses.replace(recipe.model, vocab_size=int(mixture["vocab_size"]))


def _pretrain(recipe: Recipe, out: Path, resume: str = "auto", init_from: str | None = None, **_) -> dict:
    from kiln.train.objective import masked_lm_objective  # lazy: torch, for model stages only
    from kiln.train.seq2seq import t5_trainer_kwargs  # lazy: torch, for model stages only
    from kiln.train.trainer import Trainer  # lazy: torch, for model stages only

    model_cfg = resolved_model_config(recipe)
    family = {}  # a family's objective and data instead of next-token prediction on the pack
    if arch_of(model_cfg) == "bert":
        family = masked_lm_objective(Tokenizer.load(stage_dir(recipe, "tokenizer")), recipe.train.seed)
    elif arch_of(model_cfg) == "t5":  # span corruption and the seq2seq loss
        tokenizer = stage_dir(recipe, "tokenizer") / "tokenizer.json"
        family = t5_trainer_kwargs(stage_dir(recipe, "pack"), tokenizer, recipe.train, model_cfg, _rank_and_world()[1])
    train_cfg = recipe.train
    if run_store.remote_run(recipe) and not train_cfg.checkpoint_dir:
        # Straight to the store, manifest last: a killed run resumes from there on any machine.
        ckpts = storage.join(run_store.published(recipe, "pretrain"), run_store.CHECKPOINTS)
        train_cfg = dataclasses.replace(train_cfg, checkpoint_dir=ckpts)
    try:
        trainer = Trainer(
            model_cfg,
            train_cfg,
            stage_dir(recipe, "pack"),
            out,
            recipe_dict=recipe_to_dict(recipe),
            resume=resume,
            init_from=init_from,
            parallel=recipe.parallel,
            **family,
        )
    except ConfigError as err:
        if train_cfg is recipe.train or err.key != "train.checkpoint_dir":
            raise
        raise ConfigError(
            "run.out_dir", f"the pretrain stage cannot keep its checkpoints there: {err.message}"
        ) from None
    return trainer.fit()


def _sample(recipe: Recipe, out: Path, **_) -> dict:
    from kiln.checkpoint import loaded_line, resolve_checkpoint  # lazy: torch, for model stages only
    from kiln.infer.samples import sample_texts  # lazy: torch, for model stages only
    from kiln.peft.load import load_model  # lazy: torch, for model stages only

    source = resolve_checkpoint(run_store.published(recipe, "pretrain"))
    model, manifest = load_model(source)
    print(loaded_line(source, manifest))
    tokenizer = Tokenizer.load(stage_dir(recipe, "tokenizer"))
    texts = sample_texts(model, tokenizer, recipe.sample)
    with open(out / "samples.txt", "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(f"--- sample {i} (step {manifest.get('step')}) ---\n{recipe.sample.prompt}{text}\n")
    for i, text in enumerate(texts):
        print(f"--- sample {i} (checkpoint step {manifest.get('step')}) ---\n{recipe.sample.prompt}{text}")
    return {"checkpoint_step": manifest.get("step"), "samples": len(texts), "file": str(out / "samples.txt")}


def init_checkpoint(recipe: Recipe, stage: str) -> Path:
    """Where a post-training stage starts: the policy the post-training stage before it in the run
    left (the reward model is not a policy), else pretraining's best checkpoint."""
    earlier = [s for s in POST_STAGES[: POST_STAGES.index(stage)] if s in recipe.run.stages and s != "rm"]
    if earlier:
        previous = stage_dir(recipe, earlier[-1])
        # PPO leaves the actor alone in policy/ (its checkpoints hold the critic too); a PEFT stage
        # leaves its adapters merged into plain weights in merged/.
        for name in ("policy", "merged"):
            if (previous / name).is_dir():
                return previous / name
        return previous / "checkpoints"
    return stage_dir(recipe, "pretrain") / "checkpoints"


def _post(stage: str):
    def run(recipe: Recipe, out: Path, resume: str = "auto", init_from: str | None = None, **_) -> dict:
        from kiln.post.driver import run_stage  # lazy: torch, for model stages only

        tokenizer = Tokenizer.load(stage_dir(recipe, "tokenizer"))
        init = Path(init_from) if init_from else init_checkpoint(recipe, stage)
        return run_stage(stage, recipe, out, init, tokenizer, resume=resume)

    return run


def _export(recipe: Recipe, out: Path, **_) -> dict:
    """The run's model (export_source) as a transformers folder in out, with the run's tokenizer and,
    for a post-trained model, the chat template and end-of-turn stop ids."""
    from kiln.hf import export_stage_checkpoint  # lazy: torch, for model stages only

    source = export_source(recipe)
    found = model_output(source, stage_dir(recipe, source))
    if found is None or not is_done(recipe, source):
        raise DataError(
            f"[export] the {source} stage has no finished model in {stage_dir(recipe, source)}; "
            f"run it first: kiln run RECIPE --stages {source}"
        )
    dtype = None if recipe.export.dtype == "checkpoint" else recipe.export.dtype
    tokenizer = stage_dir(recipe, "tokenizer") / "tokenizer.json"
    stats = export_stage_checkpoint(loadable(found), tokenizer, out, chat=source in POST_STAGES, dtype=dtype)
    return {"source": source, **stats}


STAGE_RUNNERS = {
    "corpus": _corpus,
    "data": _data,
    "tokenizer": _tokenizer,
    "pack": _pack,
    "pretrain": _pretrain,
    "sample": _sample,
    **{stage: _post(stage) for stage in POST_STAGES},
    "export": _export,
}


# --- the recipe verbs ---------------------------------------------------------------------------
# `kiln run`, a verb per stage, and `kiln launch` and `kiln plan`, whose recipe is read here: a recipe
# is the top layer's (kiln/recipe.py), so kiln.parallel gets the typed sections it needs from these
# verbs and keeps the rest of launch and plan. kiln/cli.py lists them; docs/pipeline.md.

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


def _plan_shape(args: argparse.Namespace):
    """(model with its vocab_size, else the tokenizer's, and the [train] workload) of the plan's recipe."""
    recipe = load_recipe(args.recipe, args.overrides)
    if arch_of(recipe.model) != "decoder":
        raise ConfigError(
            "model.arch",
            f'`kiln plan` lays out decoder models; [model] arch = "{arch_of(recipe.model)}" has no plan yet',
        )
    model = dataclasses.replace(recipe.model, vocab_size=recipe.model.vocab_size or recipe.tokenizer.vocab_size)
    return model, Workload(recipe.train.seq_len, recipe.train.global_batch_tokens)


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
    if ran and _rank_and_world()[0] == 0:
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
    if _rank_and_world()[0] == 0:
        print(next_command(target, recipe.run.stages, args.recipe, stage_dir(recipe, target), recipe.sample.prompt))
