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


def write_parquet_with_bad_utf8(path, columns: dict[str, list[str]], bad_column: str, bad_row: int) -> None:
    """A Parquet file whose string column `bad_column` holds an invalid UTF-8 byte in row `bad_row`,
    as writers that do not validate strings produce (pyarrow itself refuses to build one)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = [v.encode("utf-8") for v in columns[bad_column]]
    values[bad_row] = values[bad_row] + b"\xff"
    offsets = [0]
    for v in values:
        offsets.append(offsets[-1] + len(v))
    buffer = pa.py_buffer(b"".join(int.to_bytes(o, 4, "little") for o in offsets))
    bad = pa.Array.from_buffers(pa.string(), len(values), [None, buffer, pa.py_buffer(b"".join(values))])
    pq.write_table(pa.table({**columns, bad_column: bad}), path)
