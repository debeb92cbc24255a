"""Read raw documents from JSONL (plain, .gz, .zst), Parquet and folders of text files.

Every input record becomes either a document `{"id", "text", "source", "meta"}` or a rejection
`{"file", "line", "reason", "raw"}`; a bad record never stops the read, so one corrupt line in a
million-line dump costs one line, and the rejection says exactly where it was.

`read_documents(path)` yields `(doc, None)` or `(None, rejection)` pairs in file order. Rejection
reasons:

- `bad_utf8`: the line (or text file) is not valid UTF-8, or a JSON escape left a lone surrogate;
- `bad_json`: the line does not parse; `not_an_object`: it parses to a list, number, ...;
- `missing_text` / `text_not_string` / `empty_text` (empty or whitespace only);
- `bad_id` / `bad_source` / `bad_meta`: a field of the wrong type (id may be a string or integer);
- `corrupt_file`: the compressed stream or Parquet file is damaged; the rest of that file is lost
  and the read continues with the next file (`line` is the first record not read).

Defaults for fields a record lacks: `id` = `<name>:<line>` (name = the file's path inside the folder
it was listed from, so ids are stable across machines and working directories); `source` = the
reader's `source` argument, else the file stem (`web.jsonl.zst` -> `web`), and for text files the
name of the folder holding them (a folder of files is one source, not one source per file);
`meta` = {}. Other top-level fields (`url`, `date`, ...) move into `meta` rather than vanish.
Which fields those are is a `FieldMap` (kiln.data.fields: `text_key`, `id_key`, `meta_keys`, presets
for public layouts); `check_layout` refuses a file in another layout as one line before a run.
For Parquet, `line` is the 1-based row number.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Iterator

from kiln import storage
from kiln.data.fields import DEFAULT_FIELDS, FieldMap, has_field, map_record
from kiln.data.warc import DEFAULT_EXTRACTOR, is_warc, read_warc
from kiln.errors import DataError

RAW_CHARS = 200  # enough of a bad record to recognise it in rejected/ without copying huge lines
JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSED_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
TEXT_SUFFIXES = (".txt", ".md")
PARQUET_SUFFIXES = (".parquet",)
DOC_FIELDS = ("id", "text", "source", "meta")

Record = tuple[dict | None, dict | None]  # (document, None) or (None, rejection)


def input_format(path: Path) -> str | None:
    """'jsonl', 'parquet', 'text' or 'warc' from the file name, None if it is none of them."""
    name = path.name.lower()
    if is_warc(name):
        return "warc"
    for suffix in COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    else:
        if name.endswith(PARQUET_SUFFIXES):
            return "parquet"
        if name.endswith(TEXT_SUFFIXES):
            return "text"
    return "jsonl" if name.endswith(JSONL_SUFFIXES) else None


def file_stem(path: Path) -> str:
    """The name without format and compression suffixes: `web-00.jsonl.zst` -> `web-00`."""
    name = path.name
    for suffix in COMPRESSED_SUFFIXES:
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
            break
    return Path(name).stem


def _expand(entry: str | Path) -> list[tuple[Path, str]]:
    """Files of one input entry (file, folder or glob), sorted, each with its stable name."""
    text = str(entry)
    if storage.is_remote(entry):
        return _expand_remote(text)
    if any(ch in text for ch in "*?["):
        matches = sorted(Path(p) for p in glob.glob(text, recursive=True))
        files = [p for p in matches if p.is_file() and input_format(p)]
        if not files:
            raise DataError(f"{text}: the pattern matches no JSONL, Parquet or text files")
        return [(p, p.name) for p in files]
    path = Path(entry)
    if path.is_dir():
        # Hidden files and folders are editor and VCS litter (.git, .DS_Store), never data.
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and input_format(p) and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataError(f"{path}: the folder holds no JSONL, Parquet or text files")
        return [(p, f"{path.name}/{p.relative_to(path).as_posix()}") for p in files]
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if input_format(path) is None:
        raise DataError(
            f"{path}: unknown input format; expected .jsonl/.ndjson (optionally .gz/.zst), .parquet, .txt, .md, .warc or .warc.gz"
        )
    return [(path, path.name)]


def _expand_remote(entry: str) -> list[tuple[Path, str]]:
    """A remote entry's files (kiln.storage URLs), each copied to the local cache and named as the
    same layout on local disk would name it, so ids and sources do not depend on where data lives."""
    if any(ch in entry for ch in "*?["):
        found = [(url, storage.name_of(url)) for url in storage.glob(entry)]
    elif storage.isdir(entry):
        base = entry.rstrip("/")
        found = [(url, f"{storage.name_of(base)}/{url[len(base) + 1 :]}") for url in storage.walk_files(base)]
        found = [(url, name) for url, name in found if not any(part.startswith(".") for part in name.split("/"))]
    elif storage.isfile(entry):
        found = [(entry, storage.name_of(entry))]
    else:
        raise DataError(f"{entry}: no such file or folder")
    found = [(url, name) for url, name in found if input_format(Path(name))]
    if not found:
        raise DataError(f"{entry}: matches no JSONL, Parquet or text files")
    return [(storage.fetch_file(url), name) for url, name in found]


def list_named_inputs(paths: str | Path | Iterable[str | Path]) -> list[tuple[Path, str]]:
    """Like list_inputs, with each file's stable name (used in default ids)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    seen: set[Path] = set()
    out = []
    for entry in paths:
        for path, name in _expand(entry):
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                out.append((path, name))
    return out


def list_inputs(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """Files to read: each entry a file, a folder (searched recursively) or a glob pattern.

    Each entry's files are sorted, entries keep their order and a file listed twice is read once,
    so the list (and therefore the task sharding built on it) is the same on every run.
    """
    return [path for path, _ in list_named_inputs(paths)]


def read_inputs(paths: str | Path | Iterable[str | Path], source: str | None = None) -> Iterator[Record]:
    """read_documents over every file of list_inputs(paths)."""
    for path, name in list_named_inputs(paths):
        yield from read_documents(path, source, name=name)


def read_documents(
    path: str | Path,
    source: str | None = None,
    name: str | None = None,
    fields: FieldMap | None = None,
    html_extractor: str = DEFAULT_EXTRACTOR,
) -> Iterator[Record]:
    """Yield `(doc, None)` for each good record of one file and `(None, rejection)` for each bad one.

    `name` is the file's stable name used in default ids (default: the file name); `fields` says
    which record fields make the document (kiln.data.fields; default: `text`, `id`, `source`, `meta`).
    WARC files (kiln.data.warc) yield one document per HTML response, its main text found by
    `html_extractor`.
    """
    fields = fields or DEFAULT_FIELDS
    path = Path(path)
    fmt = input_format(path)
    if fmt is None:
        raise DataError(f"{path}: unknown input format")
    name = name or path.name
    if fmt == "text":
        yield _read_text_file(path, source or path.parent.name, name)
    elif fmt == "warc":
        yield from read_warc(path, source or file_stem(path), name, html_extractor)
    elif fmt == "parquet":
        yield from _read_parquet(path, source or file_stem(path), name, fields)
    else:
        yield from _read_jsonl(path, source or file_stem(path), name, fields)


def rejection(path: Path, line: int, reason: str, raw: str | bytes) -> dict:
    if isinstance(raw, bytes):
        raw = raw[: RAW_CHARS * 4].decode("utf-8", errors="replace")
    raw = raw.rstrip("\r\n")
    if len(raw) > RAW_CHARS:
        raw = raw[:RAW_CHARS] + "..."
    return {"file": str(path), "line": line, "reason": reason, "raw": raw}


def make_document(
    record: dict, default_id: str, default_source: str, fields: FieldMap = DEFAULT_FIELDS
) -> tuple[dict | None, str | None]:
    """A document from a parsed record, or (None, reason) when a field is unusable (kiln.data.fields)."""
    return map_record(record, default_id, default_source, fields)


def has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


LONE_SURROGATE = "holds a lone surrogate (a \\ud800-\\udfff escape), which is not UTF-8 text"


def line_has_lone_surrogate(line: "JsonLine") -> bool:
    """Whether a parsed line holds a lone surrogate in any field. Python decodes a "\\ud800" escape
    without complaint, but no UTF-8 writer or tokenizer accepts the result; only a line with such
    an escape is re-encoded to find out."""
    if line.record is None or "\\ud" not in line.raw.lower():
        return False
    return has_lone_surrogate(json.dumps(line.record, ensure_ascii=False))


def open_binary(path: Path) -> IO[bytes]:
    kind = next((k for s, k in COMPRESSED_SUFFIXES.items() if path.name.lower().endswith(s)), None)
    if kind == "gzip":
        return gzip.open(path, "rb")
    if kind == "zstd":
        try:
            import zstandard
        except ImportError:
            if sys.version_info >= (3, 14):
                from compression import zstd  # the standard library has zstd from 3.14 on

                return zstd.open(path, "rb")
            raise DataError(f"{path}: reading .zst needs the `zstandard` package (pip install zstandard)") from None
        fh = open(path, "rb")
        # read_across_frames: files written by pzstd or by appending hold several frames.
        reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True, closefd=True)
        return io.BufferedReader(reader)
    return open(path, "rb")


def decompress_errors() -> tuple[type[BaseException], ...]:
    # gzip.BadGzipFile is an OSError; a damaged deflate stream inside a good header is a zlib.error.
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


@dataclass(slots=True)
class JsonLine:
    """One non-blank line of a JSONL file: its 1-based number, the object it holds (None when it
    holds none), the line as read (bytes when it is not UTF-8) and what is wrong with it."""

    number: int
    record: dict | None
    raw: str | bytes
    problem: str | None = None  # bad_utf8 | bad_json | not_an_object
    error: Exception | None = None  # the decoder's exception, for messages that quote it

    @property
    def why(self) -> str:
        """The problem in words, for a one-line error naming path:line."""
        if self.problem == "bad_utf8":
            return "not UTF-8 text"
        if self.problem == "bad_json":
            if isinstance(self.error, json.JSONDecodeError):
                return f"not JSON ({self.error.msg} at column {self.error.colno})"
            return f"not JSON ({self.error})"
        return "not a JSON object" if self.problem else ""


def read_json(path: Path) -> dict:
    """One JSON file (a config or index), refused as one line naming the path when missing or invalid."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: not found") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None


def iter_jsonl(path: str | Path, decode_errors: str = "strict") -> Iterator[JsonLine]:
    """Every non-blank line of a JSONL file (plain, .gz or .zst), parsed, in order.

    A malformed line comes back with its problem instead of raising, so each caller decides what
    a bad line means: refuse the file naming path:line, or count and quarantine the line. Errors of
    the file itself (unreadable, a damaged compressed stream) propagate.
    """
    with open_binary(Path(path)) as fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue  # blank lines (a trailing newline, a separator) are not records
            try:
                text = raw.decode("utf-8", errors=decode_errors)
            except UnicodeDecodeError as err:
                yield JsonLine(number, None, raw, "bad_utf8", err)
                continue
            try:
                record = json.loads(text)
            except (ValueError, RecursionError) as err:
                # ValueError: JSONDecodeError, or an integer over Python's 4300-digit limit;
                # RecursionError: arrays or objects nested thousands deep.
                yield JsonLine(number, None, text, "bad_json", err)
                continue
            if not isinstance(record, dict):
                yield JsonLine(number, None, text, "not_an_object")
                continue
            yield JsonLine(number, record, text)


def read_utf8_text(path: str | Path) -> str:
    """A whole text file that must be UTF-8 (an evaluation's prompts or documents); otherwise a
    DataError naming path:line and the first byte that is not."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at column {column})") from None


def strict_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of every non-blank line of a JSONL file that must be well formed (a
    corpus folder, an evaluation task): a malformed line, or one holding a lone surrogate, is a
    DataError naming path:line."""
    for line in iter_jsonl(path):
        if line.problem:
            raise DataError(f"{path}:{line.number}: {line.why}")
        if line_has_lone_surrogate(line):
            raise DataError(f"{path}:{line.number}: {LONE_SURROGATE}")
        yield line.number, line.record


def _read_jsonl(path: Path, source: str, name: str, fields: FieldMap) -> Iterator[Record]:
    errors = decompress_errors()
    line_no = 0
    try:
        for line in iter_jsonl(path):
            line_no = line.number
            yield _document(path, line, source, name, fields)
    except errors as err:
        kind = "zlib.error" if isinstance(err, zlib.error) else type(err).__name__  # its own name is "error"
        yield None, rejection(path, line_no + 1, "corrupt_file", f"{kind}: {err}")


def _document(path: Path, line: JsonLine, source: str, name: str, fields: FieldMap) -> Record:
    if line.problem:
        return None, rejection(path, line.number, line.problem, line.raw)
    doc, reason = map_record(line.record, f"{name}:{line.number}", source, fields)
    if doc is not None and line_has_lone_surrogate(line):  # in the text, the id or the meta alike
        reason, doc = "bad_utf8", None
    if doc is None:
        return None, rejection(path, line.number, reason, line.raw)
    return doc, None


def _read_text_file(path: Path, source: str, name: str) -> Record:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1  # the line holding the first bad byte
        return None, rejection(path, line, "bad_utf8", data)
    if text.startswith("\ufeff"):
        text = text[1:]  # a byte-order mark is an encoding artefact, not content
    if not text.strip():
        return None, rejection(path, 1, "empty_text", text)
    return {"id": name, "text": text, "source": source, "meta": {}}, None


NOT_UTF8_ROW = "a string column of this row is not UTF-8"


def parquet_rows(batch) -> list[dict | None]:
    """The rows of a Parquet record batch, None for a row with a string that is not UTF-8: Arrow
    does not validate what other writers stored, and one such row must cost that row, not the file."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError:
        rows: list[dict | None] = []
        for i in range(batch.num_rows):
            try:
                rows.append(batch.slice(i, 1).to_pylist()[0])
            except UnicodeDecodeError:
                rows.append(None)
        return rows


def _read_parquet(path: Path, source: str, name: str, fields: FieldMap) -> Iterator[Record]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs the `pyarrow` package (pip install pyarrow)") from None
    row = 0
    try:
        pf = pq.ParquetFile(path)
        columns = list(pf.schema_arrow.names)
        top = fields.text_key.split(".", 1)[0]
        if fields.text_key not in columns and top not in columns:
            yield None, rejection(path, 0, "missing_text", missing_field(path, 0, columns, fields))
            return
        for batch in pf.iter_batches(batch_size=1024):
            for record in parquet_rows(batch):
                row += 1
                if record is None:
                    yield None, rejection(path, row, "bad_utf8", NOT_UTF8_ROW)
                    continue
                if isinstance(record.get("meta"), str):
                    # Writers that cannot store a map column often store meta as a JSON string.
                    try:
                        record["meta"] = json.loads(record["meta"])
                    except (ValueError, RecursionError):  # as in _parse_line
                        pass  # left a string: rejected below as bad_meta
                doc, reason = map_record(record, f"{name}:{row}", source, fields)
                if doc is None:
                    yield None, rejection(path, row, reason, json.dumps(record, default=str, ensure_ascii=False))
                else:
                    yield doc, None
    except (pyarrow.ArrowException, OSError, UnicodeDecodeError) as err:
        yield None, rejection(path, row + 1, "corrupt_file", f"{type(err).__name__}: {err}")


LAYOUT_PROBE_RECORDS = 10  # one odd record is quarantined; ten in a row without the field is a layout


def missing_field(path: Path, where: int, present: list[str], fields: FieldMap, unit: str = "row") -> str:
    """The one line saying a file's records lack the text field, and what to set instead."""
    kind = "columns" if unit == "row" else "fields"
    return (
        f"{path}: {unit} {where}: no field {fields.text_key!r} ({kind}: {', '.join(present) or 'none'}); "
        f"{fields.suggestion(present)}"
    )


def check_layout(path: Path, fields: FieldMap | None = None) -> None:
    """Refuse, as one line naming the file, a JSONL or Parquet file whose records lack the text field.

    A file in another dataset's layout would otherwise have every record quarantined one by one.
    Parquet: the schema is checked (row 0 = the schema). JSONL: the first LAYOUT_PROBE_RECORDS objects;
    the file is refused only when none of them has the field, so one odd record stays a rejection.
    Unreadable files are left to the reader, which quarantines them as corrupt_file.
    """
    fields = fields or DEFAULT_FIELDS
    fmt = input_format(path)
    if fmt == "parquet":
        try:
            import pyarrow
            import pyarrow.parquet as pq
        except ImportError:
            return  # the reader names the missing package
        try:
            columns = list(pq.ParquetFile(path).schema_arrow.names)
        except (pyarrow.ArrowException, OSError):
            return  # damage is the reader's corrupt_file
        if fields.text_key not in columns and fields.text_key.split(".", 1)[0] not in columns:
            raise DataError(missing_field(path, 0, columns, fields))
    elif fmt == "jsonl":
        first, probed = None, 0
        try:
            for line in iter_jsonl(path):
                if line.record is None:
                    continue
                if has_field(line.record, fields.text_key):
                    return
                first, probed = first or line, probed + 1
                if probed >= LAYOUT_PROBE_RECORDS:
                    break
        except decompress_errors():
            return
        if first is not None:
            raise DataError(missing_field(path, first.number, list(first.record), fields, unit="line"))
