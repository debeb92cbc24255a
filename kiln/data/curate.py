"""`kiln data`: raw documents in, curated documents out, through the configured list of steps."""

from __future__ import annotations

from pathlib import Path

from kiln.data.config import CurateConfig
from kiln.data.executor import run_pipeline
from kiln.data.funnel import funnel_html, funnel_text
from kiln.data.ray_executor import run_pipeline_ray
from kiln.data.readers import list_named_inputs
from kiln.errors import ConfigError
from kiln.storage import staged_output


def curate(cfg: CurateConfig, out_dir: Path | str, default_inputs: list[Path] = (), log=print) -> dict:
    """Run the pipeline of `cfg` over `cfg.inputs` (or `default_inputs`) into `out_dir`.

    Writes out_dir/docs/*.jsonl (the curated documents, the input of the tokenizer and packer),
    out_dir/rejected/, out_dir/stats.json and out_dir/funnel.html (a chart of documents and bytes kept
    per step); returns the stats and logs the funnel as text. `out_dir` may be an fsspec URL.
    """
    # list_named_inputs raises a one-line DataError for a path or glob that matches nothing.
    files = list_named_inputs(cfg.inputs) if cfg.inputs else [(Path(p), Path(p).name) for p in sorted(default_inputs)]
    if not files:
        raise ConfigError("data.inputs", "is empty and there is no corpus stage output to curate")
    # An object store has no rename: the stage runs in a local folder, uploaded with stats.json last.
    with staged_output(out_dir, "stats.json") as out:
        if cfg.executor == "ray":
            stats = run_pipeline_ray(
                files, cfg.build_steps(), out, tasks=cfg.tasks, address=cfg.ray_address or None, log=log
            )
        else:
            stats = run_pipeline(files, cfg.build_steps(), out, tasks=cfg.tasks, workers=cfg.workers, log=log)
        (out / "funnel.html").write_text(funnel_html(stats, f"Data funnel: {out_dir}"), encoding="utf-8")
    log(funnel_text(stats))
    return stats
