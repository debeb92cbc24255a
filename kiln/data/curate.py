"""`kiln data`: raw documents in, curated documents out, through the configured list of steps."""

from __future__ import annotations

from pathlib import Path

from kiln.data.config import CurateConfig
from kiln.data.executor import run_pipeline
from kiln.data.funnel import funnel_html, funnel_text
from kiln.data.ray_executor import run_pipeline_ray
from kiln.data.readers import list_named_inputs
from kiln.data.warc import check_extractor, is_warc
from kiln.errors import ConfigError


def curate(cfg: CurateConfig, out_dir: Path, default_inputs: list[Path] = (), log=print) -> dict:
    """Run the pipeline of `cfg` over `cfg.inputs` (or `default_inputs`) into `out_dir`.

    Writes out_dir/docs/*.jsonl (the curated documents, the input of the tokenizer and packer),
    out_dir/rejected/, out_dir/stats.json and out_dir/funnel.html (a chart of documents and bytes kept
    per step); returns the stats and logs the funnel as text.
    """
    # list_named_inputs raises a one-line DataError for a path or glob that matches nothing.
    files = list_named_inputs(cfg.inputs) if cfg.inputs else [(Path(p), Path(p).name) for p in sorted(default_inputs)]
    if not files:
        raise ConfigError("data.inputs", "is empty and there is no corpus stage output to curate")
    if any(is_warc(path) for path, _ in files):
        try:  # before any task starts, not in every worker
            check_extractor(cfg.html_extractor)
        except ConfigError as err:
            raise err.within("data") from None
    read_options = {"html_extractor": cfg.html_extractor}
    if cfg.executor == "ray":
        stats = run_pipeline_ray(
            files,
            cfg.build_steps(),
            Path(out_dir),
            tasks=cfg.tasks,
            address=cfg.ray_address or None,
            log=log,
            read_options=read_options,
        )
    else:
        stats = run_pipeline(
            files,
            cfg.build_steps(),
            Path(out_dir),
            tasks=cfg.tasks,
            workers=cfg.workers,
            log=log,
            read_options=read_options,
        )
    (Path(out_dir) / "funnel.html").write_text(funnel_html(stats, f"Data funnel: {out_dir}"), encoding="utf-8")
    log(funnel_text(stats))
    return stats
