"""The closing lines of a stage, for a person: the headline number, where the output is, and the
command to run next. The stage's full stats stay machine-readable in its stats.json; these lines
are formatted from them and never parsed back.

`stage_lines(stage, out, stats)` is what `kiln run` and each stage verb print when a stage ends;
`next_command(...)` the single `next:` line printed after the last stage of an invocation.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from kiln.recipe import POST_STAGES

MODEL_STAGES = ("pretrain", *POST_STAGES)


def _finite(value) -> bool:
    """A number to print: summaries written before 2026-12-07 hold NaN where bits per byte is undefined."""
    return isinstance(value, float) and math.isfinite(value)


def _num(value) -> str:
    """A count with thousands separators; a float with 3 significant digits; '?' when absent."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "?"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1000):
        return f"{int(value):,}"
    return f"{value:.3g}"


def _headline(stage: str, stats: dict) -> str | None:
    if stage == "corpus":
        return f"{_num(stats.get('documents'))} documents, {_num(stats.get('bytes'))} bytes"
    if stage == "data":
        return f"{_num(stats.get('docs_out'))} documents kept of {_num(stats.get('docs_in'))}"
    if stage == "tokenizer" and "bytes_per_token" in stats:
        return f"{stats['bytes_per_token']:.2f} bytes/token on held-out text"
    if stage == "pack":
        train, val = stats.get("train") or {}, stats.get("val") or {}
        return (
            f"{_num(train.get('tokens'))} train tokens ({_num(train.get('documents'))} documents), "
            f"{_num(val.get('tokens'))} validation tokens ({_num(val.get('documents'))} documents)"
        )
    if stage == "pretrain":
        loss, bpb = stats.get("final_val_loss"), stats.get("final_val_bpb")
        line = f"val loss {_num(loss)}" + (f" ({bpb:.2f} bits/byte)" if _finite(bpb) else "")
        best = stats.get("best_val_loss")
        if isinstance(best, float) and best != loss:
            line += f", best {_num(best)}"
        return line + f" after {_num(stats.get('steps'))} steps, {_num(stats.get('tokens_seen'))} tokens"
    if stage == "sample":
        return f"{_num(stats.get('samples'))} samples from step {_num(stats.get('checkpoint_step'))}"
    if stage == "export" and "architecture" in stats:
        kind = "chat model" if stats.get("chat") else "model"
        return (
            f"{stats.get('source')} {kind} (step {_num(stats.get('step'))}) as {stats['architecture']}, "
            f"{stats.get('dtype')}, with its tokenizer" + (" and chat template" if stats.get("chat") else "")
        )
    return None  # post stages print their own headline (held-out accuracy, reward) in closing_lines


def model_output(stage: str, out: Path) -> Path | None:
    """The folder a model stage leaves its model in: PPO's actor (policy/), a PEFT stage's merged
    weights (merged/), else its checkpoints root, which loads by the one rule (best, else latest)."""
    for name in ("policy", "merged"):
        if (out / name).is_dir():
            return out / name
    return out / "checkpoints" if (out / "checkpoints").is_dir() else None


def _outputs(stage: str, out: Path, stats: dict) -> str:
    if stage in MODEL_STAGES:
        found = model_output(stage, out)
        if found is not None:
            return f"checkpoint: {loadable(found)}"
    if stage == "sample" and stats.get("file"):
        return f"output: {stats['file']}"
    return f"output: {out}"


def loadable(folder: Path) -> Path:
    """The checkpoint folder a loading verb would pick from `folder`, or `folder` itself."""
    from kiln.checkpoint import CheckpointError, resolve_checkpoint  # lazy: torch, for model stages only

    try:
        return resolve_checkpoint(folder)
    except CheckpointError:
        return folder


def stage_lines(stage: str, out: Path, stats: dict | None) -> list[str]:
    """The human summary of a finished stage: its headline (if the stage has one here) and outputs."""
    stats = stats or {}
    headline = _headline(stage, stats)
    lines = [f"[{stage}] {headline}"] if headline else []
    return lines + [f"[{stage}] {_outputs(stage, Path(out), stats)}"]


def next_command(
    last: str, stages: list[str], recipe_arg: str | None, out: Path, prompt: str = "def ", stats: dict | None = None
) -> str:
    """What to run after stage `last`: the recipe's next stage when it has one left, else use the
    model (generate, then serve) when the last stage trained one, serve the exported model's
    checkpoint after export (`kiln serve` loads Kiln checkpoints; transformers loads the export),
    else open the report. `stats` is the last stage's (export's names what it exported)."""
    later = [s for s in stages if stages.index(s) > stages.index(last)] if last in stages else []
    recipe = shlex.quote(recipe_arg) if recipe_arg else "RECIPE"
    if later:  # `kiln export` is the hf verb; the export stage runs through `kiln run`
        return f"next: kiln run {recipe} --stages export" if later[0] == "export" else f"next: kiln {later[0]} {recipe}"
    if last == "export" and stats and stats.get("checkpoint"):
        ckpt, folder = shlex.quote(stats["checkpoint"]), str(out)
        local = f"kiln chat {ckpt}" if stats.get("chat") else f"kiln generate {ckpt} --prompt {shlex.quote(prompt)}"
        return (
            f"next: kiln serve {ckpt}   (or: {local}; in transformers: "
            f"AutoModelForCausalLM.from_pretrained({folder!r}))"
        )
    model_stage = last if last in MODEL_STAGES else ("pretrain" if last == "sample" else None)
    if model_stage is not None:
        found = model_output(model_stage, out.parent / model_stage)
        if found is not None:
            ckpt = shlex.quote(str(loadable(found)))
            return f"next: kiln generate {ckpt} --prompt {shlex.quote(prompt)}   (or: kiln serve {ckpt})"
    return f"next: kiln report {shlex.quote(str(out.parent))}"
