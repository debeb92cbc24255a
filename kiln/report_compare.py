"""`kiln report RUN1 RUN2 ...`: several runs (a sweep's trials, a baseline and a change) on one
page. Each training stage that any run logged gets its loss curves with every run on the same
axes, one colour per run and a legend; a table puts the runs' headline numbers side by side.
Everything is read with the single-run report's forgiving readers: kiln.report opens the runs
(kiln.report.Run) and hands them here (`kiln.report.compare_runs` is the entry point), so this
module needs nothing from it."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from kiln.recipe import STAGES
from kiln.report_plots import MAX_POINTS, Plot, Series, fmt_value, line_plot, page, table

STAGE_HEADLINE = ("final train loss", "final val loss", "best val loss", "steps")


def _labels(runs: list) -> list[str]:
    """One legend label per run: its name, or its folder where two runs share a name."""
    names = [r.name for r in runs]
    return [r.name if names.count(r.name) == 1 else f"{r.name} ({r.path})" for r in runs]


def _points(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and "step" in r]
    return [float(x) for x, _ in pairs], [float(y) for _, y in pairs]


def _stage_plots(stage: str, runs: list, labels: list[str], log: bool) -> list[Plot]:
    train, val = [], []
    for run, label in zip(runs, labels):
        m = run.metrics(stage)
        if m is None:
            continue
        xs, ys = _points(m.train, "loss")
        if xs:
            train.append(Series(label, xs, ys))
        xs, ys = _points(m.val, "val_loss")
        if xs:
            val.append(Series(label, xs, ys, markers=True))
    plots = [
        Plot(f"compare-{stage}-train-loss", f"{stage}: train loss", "step", "loss (nats/token)", train, log_y=log),
        Plot(f"compare-{stage}-val-loss", f"{stage}: validation loss", "step", "loss (nats/token)", val, log_y=log),
    ]
    return [p for p in plots if p.series]


def _stage_row(run, stage: str) -> dict:
    m = run.metrics(stage)
    if m is None:
        return {}
    losses = _points(m.train, "loss")[1]
    vals = _points(m.val, "val_loss")[1]
    steps = _points(m.train, "loss")[0]
    return {
        "final train loss": losses[-1] if losses else None,
        "final val loss": vals[-1] if vals else None,
        "best val loss": min(vals) if vals else None,
        "steps": int(steps[-1]) if steps else None,
    }


def compare(runs: list, headline: tuple[str, ...], log: bool = False, max_points: int = MAX_POINTS):
    """(HTML page, plain-text table, warnings) comparing `runs` (kiln.report.Run objects, two or
    more); `headline` names the keys of each run's pretrain/summary.json put side by side."""
    labels = _labels(runs)
    stages = [s for s in STAGES if any(r.metrics(s) is not None for r in runs)]
    sections, text = [], []
    summaries = [r.json("pretrain/summary.json") for r in runs]
    keys = [k for k in headline if any(isinstance(s, dict) and k in s for s in summaries)]
    if keys:
        rows = [[label, *((s or {}).get(k) for k in keys)] for label, s in zip(labels, summaries)]
        sections.append(("compare-summary", "Pretraining summaries", table(["run", *keys], rows, ["run", *keys])))
        text += ["run | " + " | ".join(keys)]
        text += [" | ".join(fmt_value(v, k) for k, v in zip(["run", *keys], row)) for row in rows]
    for stage in stages:
        rows = [[label, *(_stage_row(r, stage).get(k) for k in STAGE_HEADLINE)] for label, r in zip(labels, runs)]
        plots = "".join(line_plot(p, max_points=max_points) for p in _stage_plots(stage, runs, labels, log))
        body = table(["run", *STAGE_HEADLINE], rows, ["run", "loss", "val_loss", "val_loss", "steps"])
        sections.append((f"compare-{stage}", f"{stage}", f'<div class="plots">{plots}</div>' + body))
        text += ["", f"== {stage} ==", "run | " + " | ".join(STAGE_HEADLINE)]
        text += [
            " | ".join(fmt_value(v, k) for k, v in zip(["run", "loss", "val_loss", "val_loss", "steps"], row))
            for row in rows
        ]
    warnings = [w for r in runs for w in r.warnings]
    generated = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    subtitle = f"{len(runs)} runs: " + ", ".join(str(r.path) for r in runs) + f" · generated {generated}"
    title = "Kiln runs compared: " + ", ".join(labels)
    return page(title, subtitle, warnings, sections), "\n".join(text), warnings


def default_out(run_dirs: list) -> Path:
    """compare.html in the folder the runs share (a sweep's folder for its trials)."""
    return Path(os.path.commonpath([str(Path(p).resolve()) for p in run_dirs])) / "compare.html"


def write_page(text: str, out: Path) -> Path:
    """`text` into `out` (a folder gets compare.html inside), atomically: a browser reloading
    mid-write never sees half a page."""
    out = Path(out)
    if out.is_dir():
        out = out / "compare.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return out
