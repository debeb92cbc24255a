"""Shared fixtures of the data tests."""

import sysconfig
from pathlib import Path

import pytest


def _stdlib_chunks(n: int, words: int = 300, reverse: bool = False) -> list[str]:
    """n chunks of `words` whitespace tokens from the Python standard library's own files: real text
    nobody here wrote, the same on every machine with the same Python."""
    docs = []
    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for path in paths[::-1] if reverse else paths:
        toks = path.read_text(encoding="utf-8", errors="replace").split()
        for i in range(0, len(toks) - words, words):
            docs.append(" ".join(toks[i : i + words]))
            if len(docs) == n:
                return docs
    return docs


@pytest.fixture(scope="session")
def stdlib_chunks():
    """stdlib_chunks(n, words=300, reverse=False) -> list of real-text documents."""
    return _stdlib_chunks
