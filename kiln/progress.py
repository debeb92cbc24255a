"""Console progress for the long-running verbs (data, tokenizer, pack, eval, training): tqdm bars
on stderr, drawn on rank 0 only, and only on a terminal unless KILN_PROGRESS says otherwise.

A bottom-layer module: every stage may import it; it imports nothing of Kiln.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

# Set KILN_PROGRESS=1 to force bars on (e.g. in a log file), 0 to force them off.
PROGRESS_ENV = "KILN_PROGRESS"


def is_rank_zero() -> bool:
    """True unless a launcher (torchrun, Slurm via torchrun) says this is another rank."""
    return os.environ.get("RANK", "0") == "0"


def progress_enabled() -> bool | None:
    """Whether to draw progress bars: never off rank 0; KILN_PROGRESS=1/0 forces on/off; otherwise
    None, which tqdm reads as "only when stderr is a terminal", so log files stay clean."""
    if not is_rank_zero():
        return False
    forced = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    return None


def progress_visible() -> bool:
    """progress_enabled() resolved to a yes or no (for code that must decide before drawing)."""
    enabled = progress_enabled()
    if enabled is None:
        return sys.stderr.isatty()
    return enabled


def progress(iterable=None, *, total=None, desc: str | None = None, unit: str = "it", **kwargs):
    """A tqdm bar on stderr with rate and ETA, following progress_enabled()."""
    enabled = progress_enabled()
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        dynamic_ncols=True,
        disable=None if enabled is None else not enabled,
        **kwargs,
    )


__all__ = ["is_rank_zero", "progress_enabled", "progress_visible", "progress", "PROGRESS_ENV"]
