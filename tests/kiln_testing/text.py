"""Real text nobody here wrote: the Python standard library's own source files, the same on every
machine with the same Python."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def _stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def stdlib_texts(n_files: int = 40, chars: int = 6000) -> list[str]:
    """The first `chars` characters of each of the first `n_files` stdlib modules (by file name)."""
    return [p.read_text(encoding="utf-8", errors="replace")[:chars] for p in _stdlib_files()[:n_files]]


def stdlib_chunks(n: int, words: int = 300, reverse: bool = False) -> list[str]:
    """n chunks of `words` whitespace tokens each, read through the stdlib modules in file-name order
    (or backwards); fewer if the library runs out."""
    docs = []
    paths = _stdlib_files()
    for path in paths[::-1] if reverse else paths:
        toks = path.read_text(encoding="utf-8", errors="replace").split()
        for i in range(0, len(toks) - words, words):
            docs.append(" ".join(toks[i : i + words]))
            if len(docs) == n:
                return docs
    return docs
