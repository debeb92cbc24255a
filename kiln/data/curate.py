"""`kiln data`: raw documents in, curated documents out, through the configured list of steps."""

from __future__ import annotations

import json
from pathlib import Path

from kiln import storage
from kiln.data.config import CurateConfig
from kiln.data.executor import run_pipeline
from kiln.data.fields import FieldMap
from kiln.data.funnel import funnel_html, funnel_text
from kiln.data.ray_executor import run_pipeline_ray
from kiln.data.readers import check_layout, input_format, list_named_inputs
from kiln.data.slurm_executor import run_pipeline_slurm
from kiln.data.steps.bias import bias_rates
from kiln.data.warc import check_extractor, is_warc
from kiln.errors import ConfigError
from kiln.storage import staged_output


def curate(cfg: CurateConfig, out_dir: Path | str, default_inputs: list[Path] = (), log=print) -> dict | None:
    """Run the pipeline of `cfg` over `cfg.inputs` (or `default_inputs`) into `out_dir`.

    Writes out_dir/docs/*.jsonl (the curated documents, the input of the tokenizer and packer),
    out_dir/rejected/, out_dir/stats.json and out_dir/funnel.html (a chart of documents and bytes kept
    per step); returns the stats and logs the funnel as text. `out_dir` may be an fsspec URL (not with
    executor = "slurm"). With executor = "slurm" it submits the jobs (or only writes them: dry_run) and
    returns None, unless an earlier submission has finished every task: then it returns that run's stats.
    """
    files = input_files(cfg) if cfg.inputs else [(Path(p), Path(p).name, None) for p in sorted(default_inputs)]
    if not files:
        raise ConfigError("data.inputs", "is empty and there is no corpus stage output to curate")
    for path, _, fields in files:
        check_layout(path, fields)  # a file in another dataset's layout: one line now, not N rejections
    if any(is_warc(path) for path, *_ in files):
        try:  # before any task starts, not in every worker
            check_extractor(cfg.html_extractor)
        except ConfigError as err:
            raise err.within("data") from None
    read_options = {"html_extractor": cfg.html_extractor}
    if cfg.executor == "slurm":
        if storage.is_remote(out_dir):
            raise ConfigError(
                "data.executor", f"slurm array tasks write into a shared local folder, not {out_dir}: curate locally"
            )
        stats = run_pipeline_slurm(cfg, files, Path(out_dir), log=log)
        return None if stats is None else write_report(stats, Path(out_dir), log)
    # An object store has no rename: the stage runs in a local folder, uploaded with stats.json last.
    with staged_output(out_dir, "stats.json") as out:
        if cfg.executor == "ray":
            stats = run_pipeline_ray(
                files,
                cfg.build_steps(),
                out,
                tasks=cfg.tasks,
                address=cfg.ray_address or None,
                log=log,
                read_options=read_options,
            )
        else:
            stats = run_pipeline(
                files,
                cfg.build_steps(),
                out,
                tasks=cfg.tasks,
                workers=cfg.workers,
                log=log,
                read_options=read_options,
            )
        return write_report(stats, out, log, title=str(out_dir))


def write_report(stats: dict, out_dir: Path, log=print, title: str = "") -> dict:
    """stats.json (with the bias step's rates) and funnel.html of a finished curation; logs the funnel."""
    for step in stats["steps"]:
        if step["name"] == "bias":  # rates per source and group beside the raw counters
            step["rates"] = bias_rates(step)
    (Path(out_dir) / "stats.json").write_text(json.dumps(stats, indent=2))
    html = funnel_html(stats, f"Data funnel: {title or out_dir}")
    (Path(out_dir) / "funnel.html").write_text(html, encoding="utf-8")
    log(funnel_text(stats))
    return stats


def input_files(cfg: CurateConfig) -> list[tuple[Path, str, FieldMap | None]]:
    """(file, stable name, field map) for every input file, in order; a file listed by two entries
    is read once, with the first entry's fields."""
    seen: set[Path] = set()
    out = []
    for i, (entry, fields) in enumerate(cfg.input_specs()):
        # list_named_inputs raises a one-line DataError for a path or glob that matches nothing.
        for path, name in list_named_inputs(entry):
            if fields is not None and input_format(path) == "text":
                # A text file is one document with no fields: a mapping would silently do nothing.
                raise ConfigError(
                    f"data.inputs[{i}]",
                    f"{path} is a text file (one document, no fields); field keys apply to JSONL and Parquet",
                )
            if path.resolve() not in seen:
                seen.add(path.resolve())
                out.append((path, name, fields))
    return out
