"""`kiln report RUN`: one self-contained HTML page (or a plain-text summary) of a run folder.

The page is a list of sections. A section is a function registered with `@section`: it reads what
it needs from the run folder and returns a `Part` (HTML, plus lines for `--text`), or None when its
inputs do not exist, and the report then leaves it out. A section whose input is malformed turns
into a warning at the top of the page instead of failing the whole report.
"""

from __future__ import annotations

import datetime
import html
import importlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kiln.config import finite_float
from kiln.cost import CHINCHILLA_TOKENS_PER_PARAM, DEFAULT_PUE, check_options, cost_html_text, run_cost
from kiln.data.funnel import funnel_html, funnel_text
from kiln.data.readers import iter_jsonl
from kiln.errors import ConfigError, DataError
from kiln.pipeline import STAGE_INPUTS
from kiln.recipe import POST_STAGES, STAGES
from kiln.report_compare import compare, default_out, write_page
from kiln.report_plots import (
    MAX_POINTS,
    Plot,
    Series,
    cards,
    event_label,
    fmt_value,
    kv_table,
    line_plot,
    page,
    table,
    training_plots,
)

TRAIN_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "hfu", "peak_mem_mb", "tokens_seen", "batch_tokens")
# Families of training keys ("grad_norm/attn", "sys/ram_mb"): each value must be a number, or null.
TRAIN_PREFIXES = ("grad_norm/", "sys/")
VAL_FIELDS = ("val_loss", "val_bpb", "val_tokens", "val_sequences", "tokens_seen")
# The replay pack's split (train.replay): val_loss/replay, val_bpb/replay, ...
VAL_FIELDS += tuple(f"{k}/replay" for k in VAL_FIELDS[:4])
SHOWN_SKIPS = 5  # malformed lines listed by number in a warning; the rest are counted
HEADLINE = (
    "steps",
    "tokens_seen",
    "final_val_loss",
    "final_val_bpb",
    "final_val_loss/replay",  # train.replay: the earlier pack's split, where forgetting shows
    "best_val_loss",
    "best_step",
    "tokens_per_s",
    "mfu",
    "peak_mem_mb",
    "wall_s",
    "device",
)  # of summary.json, for --text
SAMPLE_CHARS = 64_000  # of sample/samples.txt shown; the rest is cut with a note


@dataclass
class ReportOptions:
    loss_scale: str = "linear"  # "linear" or "log": the y axis of the loss plots
    max_points: int = MAX_POINTS  # per plotted series; longer ones are thinned keeping extremes
    strict: bool = False  # a malformed metrics line fails the report instead of being skipped
    # Cost (kiln.cost.run_cost): None takes what the summary says or the hardware table's figure.
    hardware: str | None = None
    price_per_hour: float | None = None
    pue: float = DEFAULT_PUE
    power_w: float | None = None
    cores: int | None = None
    token_budget: float | None = None  # tokens to price at the measured throughput, like `kiln plan --tokens`


@dataclass
class Part:
    """What a section function returns: its HTML, and its plain-text lines for `--text` ("" omits)."""

    html: str
    text: str = ""


@dataclass(frozen=True)
class SectionSpec:
    key: str  # HTML id of the section
    title: str
    order: float  # position on the page, ascending
    inputs: tuple[str, ...]  # paths in the run folder it reads, named in its warnings
    render: Callable[["Run", ReportOptions], Part | None]


SECTIONS: dict[str, SectionSpec] = {}
# Modules elsewhere in Kiln that register sections of their own. They are imported when a report is
# built, not when this module loads, so they may import kiln.report without an import cycle.
SECTION_MODULES: list[str] = []


def section(key: str, title: str, order: float, inputs: tuple[str, ...] = ()):
    """Register `fn(run, opts) -> Part | None` as a report section."""

    def register(fn):
        if key in SECTIONS:
            raise ValueError(f"report section {key!r} is registered twice")
        SECTIONS[key] = SectionSpec(key, title, order, tuple(inputs), fn)
        return fn

    return register


@dataclass
class Metrics:
    """The records of one metrics.jsonl, by kind, and the lines that could not be read."""

    path: Path
    train: list[dict] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    other: int = 0  # records of kinds not drawn
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line number, why)


def _check_record(record) -> str | None:
    """Why a parsed line cannot be used, or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return "no integer 'step'"
    kind = record.get("kind", "train")
    keys = list({"train": TRAIN_FIELDS, "val": VAL_FIELDS}.get(kind, ()))
    if kind == "train":
        keys += [k for k in record if isinstance(k, str) and k.startswith(TRAIN_PREFIXES)]
    for key in keys:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{key!r} is not a number: {value!r:.40}"
    return None


def read_metrics(path, strict: bool = False) -> Metrics:
    """Parse a metrics.jsonl. A malformed line (a crash cuts the last one short; a hand edit breaks
    one) is skipped and recorded with its number, or raises DataError naming path:line if strict."""
    path = Path(path)
    metrics = Metrics(path)
    # Undecodable bytes are replaced, not refused: a metrics file is read to draw what it can.
    for line in iter_jsonl(path, decode_errors="replace"):
        record = line.record
        why = line.why or _check_record(record)
        if why:
            if strict:
                raise DataError(f"{path}:{line.number}: {why}")
            metrics.skipped.append((line.number, why))
            continue
        kind = record.get("kind", "train")  # MetricsLogger treats a record without a kind as training
        if kind == "train":
            metrics.train.append(record)
        elif kind == "val":
            metrics.val.append(record)
        elif kind == "event":
            metrics.events.append(record)
        else:
            metrics.other += 1
    return metrics


class Run:
    """A run folder (runs/<name>/) and cached, forgiving reads of its files."""

    def __init__(self, path, strict: bool = False):
        path = Path(path)
        if not path.exists():
            raise DataError(f"{path}: no such run folder")
        if not path.is_dir():
            raise DataError(f"{path}: not a folder; pass a run folder such as runs/<name>")
        if not (path / "recipe.json").is_file():
            if (path.parent / "recipe.json").is_file():
                raise DataError(f"{path}: is a stage folder of the run {path.parent}; pass {path.parent}")
            raise DataError(f"{path}: not a Kiln run folder (no recipe.json; `kiln run` writes one into runs/<name>/)")
        self.path = path
        self.strict = strict
        self.warnings: list[str] = []
        self._json: dict[str, object] = {}
        self._metrics: dict[str, Metrics | None] = {}
        recipe = self.json("recipe.json")
        self.recipe = recipe if isinstance(recipe, dict) else {}
        run_table = self.recipe.get("run") if isinstance(self.recipe.get("run"), dict) else {}
        self.name = str(run_table.get("name") or path.resolve().name)

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def json(self, rel: str):
        """The parsed JSON file at `rel`, or None if it is missing or malformed (malformed warns)."""
        if rel not in self._json:
            path, value = self.path / rel, None
            if path.is_file():
                try:
                    value = json.loads(path.read_text(encoding="utf-8"))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    if self.strict:
                        raise DataError(f"{path}: not valid JSON ({e})") from None
                    self.warn(f"{path}: not valid JSON ({e}); what it holds is left out")
            self._json[rel] = value
        return self._json[rel]

    def metrics(self, stage: str) -> Metrics | None:
        """The stage's metrics.jsonl, or None if it has none."""
        if stage not in self._metrics:
            path = self.path / stage / "metrics.jsonl"
            metrics = read_metrics(path, self.strict) if path.is_file() else None
            if metrics is not None and metrics.skipped:
                listed = "; ".join(f"line {n}: {why}" for n, why in metrics.skipped[:SHOWN_SKIPS])
                more = f"; and {len(metrics.skipped) - SHOWN_SKIPS} more" if len(metrics.skipped) > SHOWN_SKIPS else ""
                self.warn(f"{path}: skipped {len(metrics.skipped)} malformed line(s) ({listed}{more})")
            self._metrics[stage] = metrics
        return self._metrics[stage]


@dataclass
class Report:
    run: Run
    parts: list[tuple[SectionSpec, Part]]
    generated: str

    @property
    def warnings(self) -> list[str]:
        return self.run.warnings

    def html(self) -> str:
        subtitle = f"{self.run.path.resolve()} · generated {self.generated}"
        return page(
            f"Kiln report: {self.run.name}",
            subtitle,
            self.warnings,
            [(spec.key, spec.title, part.html) for spec, part in self.parts],
        )

    def text(self) -> str:
        lines = [f"Kiln run {self.run.name} ({self.run.path})"]
        for spec, part in self.parts:
            if part.text:
                lines += ["", f"== {spec.title} ==", part.text]
        if self.warnings:
            lines += ["", "== Warnings =="] + [f"- {w}" for w in self.warnings]
        return "\n".join(lines)


def build_report(run_dir, opts: ReportOptions | None = None) -> Report:
    """Render every registered section that has something to show."""
    opts = opts or ReportOptions()
    if opts.loss_scale not in ("linear", "log"):
        raise ConfigError("loss_scale", f"must be linear or log, got {opts.loss_scale!r}")
    # Cost options fail here, once, rather than as a warning in every cost section.
    check_options(
        opts.hardware,
        opts.price_per_hour,
        opts.pue,
        opts.power_w,
        opts.cores,
        {"--tokens": opts.token_budget} if opts.token_budget is not None else None,
    )
    for name in SECTION_MODULES:
        importlib.import_module(name)
    run = Run(run_dir, strict=opts.strict)
    parts = []
    for spec in sorted(SECTIONS.values(), key=lambda s: s.order):
        inputs = " / ".join(str(run.path / p) for p in spec.inputs) or str(run.path)
        try:
            part = spec.render(run, opts)
        except DataError as e:
            if opts.strict:
                raise
            run.warn(f"section {spec.title!r} left out: {e}")
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            # Files written by other versions or edited by hand: one section is lost, not the report.
            if opts.strict:
                raise DataError(f"{inputs}: unexpected content ({type(e).__name__}: {e})") from e
            run.warn(f"section {spec.title!r} left out: {inputs} has unexpected content ({type(e).__name__}: {e})")
        else:
            if part is not None:
                parts.append((spec, part))
    generated = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return Report(run, parts, generated)


def write_report(run_dir, out=None, opts: ReportOptions | None = None) -> tuple[Path, Report]:
    """Write the HTML report to `out` (default RUN/report.html; a folder gets report.html inside)."""
    report = build_report(run_dir, opts)
    out = Path(out) if out else report.run.path / "report.html"
    if out.is_dir():
        out = out / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(report.html(), encoding="utf-8")
    tmp.replace(out)  # a browser reloading mid-write never sees half a page
    return out, report


# ---------------------------------------------------------------- sections


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}


def _stage_rows(run: Run) -> list[list]:
    listed = _dict(run.recipe.get("run")).get("stages") or []
    names = [s for s in STAGES if s in listed or (run.path / s).is_dir()]
    names += sorted(
        d.name
        for d in run.path.iterdir()
        if d.is_dir() and d.name not in names and ((d / "DONE").is_file() or (d / "metrics.jsonl").is_file())
    )
    rows = []
    for name in names:
        if not (run.path / name).is_dir():
            rows.append([name, "not run", None])
        elif (run.path / name / "DONE").is_file():
            rows.append([name, "done", _dict(run.json(f"{name}/DONE")).get("seconds")])
        else:
            rows.append([name, "unfinished", None])
    return rows


@section("overview", "Run", 10, ("recipe.json", "pretrain/summary.json"))
def _overview(run: Run, opts: ReportOptions) -> Part:
    rows = _stage_rows(run)
    parts = [table(["stage", "status", "seconds"], rows)]
    text = ["stages: " + ", ".join(f"{n} {st}" + (f" ({sec:.1f} s)" if _num(sec) else "") for n, st, sec in rows)]
    summary = run.json("pretrain/summary.json")
    if isinstance(summary, dict):
        parts.append("<h3>Pretraining summary</h3>" + cards(summary))
        text.append("pretrain: " + ", ".join(f"{k} {fmt_value(summary[k], k)}" for k in HEADLINE if k in summary))
    return Part("".join(parts), "\n".join(text))


def _train_table(run: Run, config_table: str) -> dict:
    """The resolved training keys of a stage: a dotted table of the recipe ("sft.train") over [train],
    whose keys (grad_clip, threads, ...) a post-training stage inherits."""
    table = _dict(run.recipe.get("train"))
    if config_table != "train":
        nested: object = run.recipe
        for part in config_table.split("."):
            nested = _dict(nested).get(part)
        table = {**table, **_dict(nested)}
    return table


def _training(run: Run, opts: ReportOptions, stage: str, config_table: str) -> Part | None:
    m = run.metrics(stage)
    if m is None:
        return None
    plots = training_plots(
        stage, m.train, m.val, m.events, opts.loss_scale == "log", _train_table(run, config_table).get("grad_clip")
    )
    other = f", {m.other} of other kinds" if m.other else ""
    note = (
        f'<p class="note">{len(m.train)} training and {len(m.val)} validation records, '
        f"{len(m.events)} events{other}, from {html.escape(str(m.path))}.</p>"
    )
    svgs = "".join(line_plot(p, max_points=opts.max_points) for p in plots)
    text = [f"{len(m.train)} training records, {len(m.val)} validation records, {len(m.events)} events"]
    losses = [r for r in m.train if _num(r.get("loss"))]
    if losses:
        low = min(losses, key=lambda r: r["loss"] if math.isfinite(r["loss"]) else float("inf"))
        text.append(
            f"train loss {losses[0]['loss']:.4f} at step {losses[0]['step']} -> {losses[-1]['loss']:.4f} "
            f"at step {losses[-1]['step']} (lowest {low['loss']:.4f} at step {low['step']})"
        )
    vals = [r for r in m.val if _num(r.get("val_loss"))]
    if vals:
        replays = [r["val_loss/replay"] for r in vals if _num(r.get("val_loss/replay"))]
        text.append(
            f"val loss {vals[-1]['val_loss']:.4f} at step {vals[-1]['step']}"
            + (
                f" (replay pack's split: {replays[0]:.4f} at the first evaluation -> {replays[-1]:.4f})"
                if replays
                else ""
            )
        )
    last = m.train[-1] if m.train else {}
    if _num(last.get("tokens_per_s")):
        text.append(
            f"last logged: {last['tokens_per_s']:.0f} tokens/s, MFU {fmt_value(last.get('mfu'), 'mfu')}, "
            f"peak memory {fmt_value(last.get('peak_mem_mb'))} MB"
        )
    return Part(note + f'<div class="plots">{svgs}</div>', "\n".join(text))


def _checkpoints(run: Run, stage: str) -> Part | None:
    root = run.path / stage / "checkpoints"
    if not root.is_dir():
        return None
    pointers = {p: (root / p).read_text().strip() for p in ("latest", "best") if (root / p).is_file()}
    folders = [d for d in root.iterdir() if d.is_dir() and d.name.split("step-")[0] in ("", "abandoned-")]
    rows = []

    def step_of(d: Path) -> int:
        digits = d.name.rsplit("-", 1)[-1]
        return int(digits) if digits.isdigit() else -1

    for d in sorted(folders, key=lambda d: (step_of(d), d.name)):
        notes = [p for p, name in pointers.items() if name == d.name]
        notes += ["abandoned"] if d.name.startswith("abandoned-") else []
        manifest = run.json(f"{stage}/checkpoints/{d.name}/manifest.json")
        if not isinstance(manifest, dict):
            rows.append([d.name, None, None, None, None, ", ".join(notes + ["no readable manifest"])])
            continue
        notes += ["sharded"] if manifest.get("layout") == "sharded" else []
        size = sum(f.get("bytes", 0) for f in _dict(manifest.get("files")).values() if isinstance(f, dict))
        rows.append(
            [
                d.name,
                manifest.get("step"),
                manifest.get("tokens_seen"),
                manifest.get("val_loss"),
                size / 2**20,
                ", ".join(notes),
            ]
        )
    if not rows:
        return None
    text = "; ".join(f"{r[0]} val {fmt_value(r[3])}" + (f" ({r[5]})" if r[5] else "") for r in rows)
    return Part(
        table(
            ["checkpoint", "step", "tokens seen", "val loss", "MB", "notes"],
            rows,
            ["checkpoint", "step", "tokens_seen", "val_loss", "mb", "notes"],
        ),
        text,
    )


def _events(run: Run, stage: str) -> Part | None:
    m = run.metrics(stage)
    if m is None or not m.events:
        return None
    rows = [[e["step"], *event_label(e)] for e in m.events]
    counts: dict[str, int] = {}
    for _, kind, _ in rows:
        counts[kind] = counts.get(kind, 0) + 1
    text = f"{len(rows)} events: " + ", ".join(f"{k} {n}" for k, n in counts.items())
    return Part(table(["step", "event", "details"], rows), text)


def _cost(run: Run, opts: ReportOptions, stage: str, config_table: str, project: bool) -> Part | None:
    summary = run.json(f"{stage}/summary.json")
    if not isinstance(summary, dict) or not _num(summary.get("wall_s")):
        return None  # no finished stage, or one from before summaries had a wall time
    budgets: dict[str, float] = {}
    table_ = _train_table(run, config_table)
    params = summary.get("params")
    if project and _num(params) and params > 0:
        budgets[f"{CHINCHILLA_TOKENS_PER_PARAM} tokens per parameter"] = CHINCHILLA_TOKENS_PER_PARAM * float(params)
    steps, per_step = table_.get("max_steps"), table_.get("global_batch_tokens")
    planned = steps * per_step if _num(steps) and _num(per_step) else 0
    if project and planned > 0 and planned != summary.get("tokens_seen"):
        budgets[f"recipe: {steps:,} steps x {per_step:,} tokens"] = float(planned)
    if project and opts.token_budget is not None:
        budgets["requested (--tokens)"] = float(opts.token_budget)
    threads = table_.get("threads")  # a recipe that pins torch's threads also says how many cores
    cores = opts.cores or (threads if isinstance(threads, int) and threads > 0 else None)
    args = dict(pue=opts.pue, power_w=opts.power_w, cores=cores, token_budgets=budgets)
    try:
        c = run_cost(summary, opts.hardware, opts.price_per_hour, **args)
    except ConfigError as e:
        if e.key != "hardware" or opts.strict:
            raise
        # One --hardware for a run whose stages ran on different devices: this one keeps its own.
        run.warn(f"{stage} cost: --hardware {opts.hardware} ignored ({e.message})")
        c = run_cost(summary, None, opts.price_per_hour, **args)
    return Part(*cost_html_text(c, stage))


def training_section(stage: str, title: str, order: float, config_table: str, project: bool = True) -> None:
    """Register the sections of a training stage that logs metrics.jsonl and keeps checkpoints/:
    its plots, its checkpoints, its events and its cost. `config_table` is the recipe table of its
    training keys ("train", or "sft.train" over [train]); `project` prices token budgets, which
    only makes sense where the trainer counts tokens (post-training may count pairs or sequences)."""
    section(f"{stage}-training", title, order, (f"{stage}/metrics.jsonl",))(
        lambda run, opts: _training(run, opts, stage, config_table)
    )
    section(f"{stage}-checkpoints", f"{title}: checkpoints", order + 0.1, (f"{stage}/checkpoints",))(
        lambda run, opts: _checkpoints(run, stage)
    )
    section(f"{stage}-events", f"{title}: events", order + 0.2, (f"{stage}/metrics.jsonl",))(
        lambda run, opts: _events(run, stage)
    )
    section(f"{stage}-cost", f"{title}: cost", order + 0.3, (f"{stage}/summary.json",))(
        lambda run, opts: _cost(run, opts, stage, config_table, project)
    )


training_section("pretrain", "Pretraining", 20, "train")
# The post-training stages run the same Trainer into runs/<name>/<stage>/, with [<stage>.train].
for _order, (_stage, _title) in enumerate(
    (
        ("sft", "SFT"),
        ("rm", "Reward model"),
        ("dpo", "DPO"),
        ("ppo", "PPO"),
        ("grpo", "GRPO"),
        ("distill", "Distillation"),
    )
):
    training_section(_stage, _title, 25 + _order, f"{_stage}.train", project=False)


def _flatten(data, prefix: str = "", out: dict | None = None, limit: int = 500) -> dict:
    out = {} if out is None else out
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else None
    if items is None:
        out[prefix or "value"] = data
        return out
    for k, v in items:
        if len(out) >= limit:
            break
        _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, limit)
    return out


@section("eval", "Evaluation", 40, ("eval",))
def _eval(run: Run, opts: ReportOptions) -> Part | None:
    """Any JSON results under eval/, as tables; scores across checkpoints when results name a step."""
    root = run.path / "eval"
    files = sorted(root.rglob("*.json")) if root.is_dir() else []
    rels = [f.relative_to(run.path).as_posix() for f in files]
    results = [(rel, _flatten(run.json(rel))) for rel in rels if run.json(rel) is not None]
    if not results:
        return None
    parts, text = [], []
    stepped = sorted(((flat["step"], flat) for _, flat in results if _num(flat.get("step"))), key=lambda p: p[0])
    if len(stepped) >= 2:
        keys = [
            k
            for k, v in stepped[0][1].items()
            if _num(v) and k not in ("step", "tokens_seen") and all(_num(flat.get(k)) for _, flat in stepped)
        ][:8]
        series = [Series(k, [s for s, _ in stepped], [flat[k] for _, flat in stepped], markers=True) for k in keys]
        if series:
            plot = Plot("eval-scores", "Evaluation scores across checkpoints", "step", "score", series)
            parts.append(f'<div class="plots">{line_plot(plot, max_points=opts.max_points)}</div>')
    for rel, flat in results:
        parts.append(f"<h3>{html.escape(rel)}</h3>" + kv_table(flat))
        shown = [f"{k}={fmt_value(v, k)}" for k, v in flat.items() if _num(v)][:8]
        text.append(f"{rel}: " + ", ".join(shown))
    return Part("".join(parts), "\n".join(text))


@section("corpus", "Corpus", 45, ("corpus/stats.json",))
def _corpus(run: Run, opts: ReportOptions) -> Part | None:
    stats = run.json("corpus/stats.json")
    if not isinstance(stats, dict):
        return None
    sources = _dict(stats.get("sources"))
    rows = [
        [
            name,
            s.get("documents"),
            s.get("bytes"),
            s.get("candidates"),
            ", ".join(f"{k} {v}" for k, v in _dict(s.get("dropped")).items()),
        ]
        for name, s in sources.items()
    ]
    totals = {k: v for k, v in stats.items() if k != "sources"}
    text = (
        f"{fmt_value(stats.get('documents'))} documents, {fmt_value(stats.get('bytes'))} bytes "
        f"from {len(sources)} sources"
    )
    return Part(kv_table(totals) + table(["source", "documents", "bytes", "candidates", "dropped"], rows), text)


@section("data", "Data curation", 50, ("data/stats.json",))
def _data(run: Run, opts: ReportOptions) -> Part | None:
    stats = run.json("data/stats.json")
    if stats is None:
        return None
    funnel_page = funnel_html(stats, "Data funnel")
    # funnel_html makes a whole page; its chart and table start at the <svg>.
    chart = funnel_page[funnel_page.index("<svg") :]
    docs_in, docs_out = stats.get("docs_in"), stats.get("docs_out")
    kept = f" ({100 * docs_out / docs_in:.1f}% kept)" if _num(docs_in) and _num(docs_out) and docs_in else ""
    intro = (
        f"<p>{fmt_value(docs_in)} documents in, {fmt_value(docs_out)} out{kept}, in "
        f"{fmt_value(stats.get('tasks'))} tasks. Documents (blue) and bytes (orange) kept after each step, "
        f"as a share of what was read.</p>"
    )
    return Part(intro + f'<div class="wide">{chart}</div>', funnel_text(stats))


@section("tokenizer", "Tokenizer", 60, ("tokenizer/stats.json",))
def _tokenizer(run: Run, opts: ReportOptions) -> Part | None:
    stats = run.json("tokenizer/stats.json")
    if not isinstance(stats, dict):
        return None
    by_source = _dict(stats.get("heldout_by_source"))
    rows = [
        [name, s.get("documents"), s.get("bytes"), s.get("tokens"), s.get("bytes_per_token")]
        for name, s in by_source.items()
    ]
    html_ = kv_table({k: v for k, v in stats.items() if k != "heldout_by_source"})
    if rows:
        html_ += "<h3>Held-out text by source</h3>" + table(
            ["source", "documents", "bytes", "tokens", "bytes/token"], rows
        )
    text = (
        f"vocabulary {fmt_value(stats.get('vocab_size'))}, {fmt_value(stats.get('bytes_per_token'))} "
        f"bytes/token on held-out text"
    )
    return Part(html_, text)


@section("pack", "Token shards", 65, ("pack/stats.json",))
def _pack(run: Run, opts: ReportOptions) -> Part | None:
    stats = run.json("pack/stats.json")
    if not isinstance(stats, dict):
        return None
    splits = [
        [
            split,
            _dict(stats.get(split)).get("documents"),
            _dict(stats.get(split)).get("tokens"),
            _dict(stats.get(split)).get("bytes"),
        ]
        for split in ("train", "val")
        if split in stats
    ]
    weights = _dict(stats.get("weights"))
    sources = [
        [name, _dict(s.get("train")).get("tokens"), _dict(s.get("val")).get("tokens"), weights.get(name)]
        for name, s in _dict(stats.get("sources")).items()
    ]
    html_ = (
        f"<p>dtype {html.escape(fmt_value(stats.get('dtype')))}, vocabulary "
        f"{html.escape(fmt_value(stats.get('vocab_size')))}.</p>"
        + table(["split", "documents", "tokens", "bytes"], splits)
    )
    if sources:
        html_ += "<h3>Mixture</h3>" + table(["source", "train tokens", "val tokens", "weight"], sources)
    text = ", ".join(f"{r[0]} {fmt_value(r[2])} tokens" for r in splits)
    return Part(html_, text)


@section("samples", "Samples", 70, ("sample/samples.txt",))
def _samples(run: Run, opts: ReportOptions) -> Part | None:
    path = run.path / "sample" / "samples.txt"
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    step = _dict(run.json("sample/stats.json")).get("checkpoint_step")
    note = f"from the checkpoint of step {step}, " if step is not None else ""
    cut = f" (first {SAMPLE_CHARS:,} of {len(text):,} characters)" if len(text) > SAMPLE_CHARS else ""
    html_ = (
        f'<p class="note">Generated text {html.escape(note)}as written to {html.escape(str(path))}{cut}.</p>'
        f"<pre>{html.escape(text[:SAMPLE_CHARS])}</pre>"
    )
    return Part(html_, text[:600] + (" ..." if len(text) > 600 else ""))


@section("config", "Configuration", 90, ("recipe.json",))
def _config(run: Run, opts: ReportOptions) -> Part | None:
    if not run.recipe:
        return None
    used = used_sections(run)
    parts = [
        f"<h3>[{html.escape(name)}]</h3>" + kv_table(values)
        if isinstance(values, dict)
        else f"<h3>{html.escape(name)}</h3>" + kv_table({name: values})
        for name, values in run.recipe.items()
        if name in used
    ]
    unused = [name for name in run.recipe if name not in used]
    note = "The resolved recipe of the latest invocation (recipe.json), the tables its stages read"
    note += f"; not used by this run: {', '.join(unused)}." if unused else "."
    return Part(f'<p class="note">{html.escape(note)}</p>' + "".join(parts))


def used_sections(run: Run) -> set[str]:
    """The recipe tables the run's stages read: [run], each stage's inputs (STAGE_INPUTS) over the
    stages that ran, less a stage's own table when that stage did not run (the corpus of a run that
    curated its own inputs), and [parallel] for a training run."""
    ran = {name for name, status, _ in _stage_rows(run) if status != "not run"}
    used = {"run"}
    for stage in ran & set(STAGE_INPUTS):
        used.update(STAGE_INPUTS[stage])
    if ran & {"pretrain", *POST_STAGES}:
        used.add("parallel")
    return {name for name in used if name not in STAGES or name in ran}


# ---------------------------------------------------------------- command line


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="HTML report of a run: loss curves, throughput, data funnel, samples")
    p.add_argument(
        "run", nargs="+", help="run folder, e.g. runs/tiny; two or more: one page overlaying them (a sweep's trials)"
    )
    p.add_argument(
        "--out", help="HTML file to write (default: RUN/report.html; several runs: compare.html beside them)"
    )
    p.add_argument("--text", action="store_true", help="print a plain-text summary instead of writing HTML")
    p.add_argument("--loss-scale", choices=("linear", "log"), default="linear", help="y axis of the loss plots")
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail on a malformed metrics line or stats file instead of skipping it with a warning",
    )
    cost = p.add_argument_group("cost (docs/cost.md)")
    cost.add_argument(
        "--hardware",
        help="what the stages ran on: a GPU of `kiln plan --gpu` (h100, a100, ...) or cpu (default: from summary.json)",
    )
    cost.add_argument(
        "--price", type=finite_float, help="USD per GPU-hour, or per core-hour on CPU (default: the hardware table's)"
    )
    cost.add_argument("--pue", type=finite_float, default=DEFAULT_PUE, help="facility power over IT power")
    cost.add_argument("--power", type=finite_float, help="watts per GPU (default: its TDP), or per CPU process")
    cost.add_argument("--cores", type=int, help="CPU cores per process (default: summary.json's threads)")
    cost.add_argument(
        "--tokens", type=finite_float, help="a token budget to price at the measured throughput, e.g. 1e12"
    )


def run(args) -> int:
    opts = ReportOptions(
        loss_scale=args.loss_scale,
        strict=args.strict,
        hardware=args.hardware,
        price_per_hour=args.price,
        pue=args.pue,
        power_w=args.power,
        cores=args.cores,
        token_budget=args.tokens,
    )
    if len(args.run) > 1:
        return _run_compare(args, opts)
    if args.text:
        print(build_report(args.run[0], opts).text())
        return 0
    out, report = write_report(args.run[0], args.out, opts)
    for warning in report.warnings:
        print(f"kiln report: warning: {warning}", file=sys.stderr)
    print(f"wrote {out} ({len(report.parts)} sections); open it in a browser, no network needed")
    return 0


def compare_runs(run_dirs: list, opts: ReportOptions | None = None) -> tuple[str, str, list[str]]:
    """(HTML page, plain-text table, warnings) overlaying two or more run folders (kiln.report_compare)."""
    opts = opts or ReportOptions()
    if len(run_dirs) < 2:
        raise ConfigError("run", "an overlay needs two or more run folders")
    runs = [Run(p, strict=opts.strict) for p in run_dirs]
    return compare(runs, HEADLINE, opts.loss_scale == "log", opts.max_points)


def _run_compare(args, opts: ReportOptions) -> int:
    html_, text, warnings = compare_runs(args.run, opts)
    if args.text:
        print(text)
        return 0
    out = write_page(html_, Path(args.out) if args.out else default_out(args.run))
    for warning in warnings:
        print(f"kiln report: warning: {warning}", file=sys.stderr)
    print(f"wrote {out} ({len(args.run)} runs overlaid); open it in a browser, no network needed")
    return 0
