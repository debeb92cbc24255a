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

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from kiln import run_store, storage
from kiln.data.corpus import build_corpus
from kiln.data.curate import curate
from kiln.data.pack import pack
from kiln.data.slurm_executor import SLURM_DIR
from kiln.data.tokenizer import Tokenizer, train_tokenizer_from_corpus
from kiln.data.warc_demo import ensure_demo_crawl
from kiln.errors import ConfigError, DataError
from kiln.files import write_text_atomic
from kiln.model.config import arch_of
from kiln.recipe import POST_STAGES, STAGES, Recipe, export_source, recipe_to_dict
from kiln.run_store import MARKER
from kiln.stage_summary import loadable, model_output, stage_lines
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
    rank, world = rank_and_world()
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


def rank_and_world() -> tuple[int, int]:
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
        family = t5_trainer_kwargs(stage_dir(recipe, "pack"), tokenizer, recipe.train, model_cfg, rank_and_world()[1])
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
