"""Build a document corpus from real text that ships with every machine Kiln runs on.

Three built-in sources, none written by this project:

- ``python_stdlib``: the running interpreter's standard library ``.py`` files (PSF license).
- ``python_docs``: the reference-manual topics bundled as ``pydoc_data.topics``, the docstrings of
  the standard library modules (read with ``ast``, never imported), and the library's own prose
  files (``*.txt``/``*.rst``) (PSF license).
- ``debian_docs``: ``/usr/share/doc/<package>/`` copyright files, READMEs, changelogs and text
  notes; each file is under its own package's license, named in that package's ``copyright`` file.
  Skipped (with a note in stats) where the folder does not exist.

Output: ``out_dir/docs-00000.jsonl`` ... with one ``{"id", "text", "source", "meta"}`` record per
line, ``out_dir/rejected/rejected.jsonl`` for everything dropped, and ``out_dir/stats.json``.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
import random
import sysconfig
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from kiln.data.config import CorpusConfig
from kiln.data.readers import strict_records
from kiln.errors import DataError

# Module-level so tests can point the Debian source at a folder they build.
DEBIAN_DOC_ROOT = Path("/usr/share/doc")

# The test suites hold deliberately malformed and oddly encoded files (bad syntax, latin-1
# fixtures, huge generated data) and very repetitive boilerplate; the library code itself is the
# representative Python. site-packages is third-party code under other licenses, not the stdlib.
STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})

# Debian documentation files that are prose written for people, not HTML/CSS/build files.
DEBIAN_NAMES = ("copyright", "changelog", "news", "readme", "authors", "thanks", "todo", "faq")
DEBIAN_SUFFIXES = (".txt", ".md", ".rst")

PSF_LICENSE = "PSF-2.0"
DOCS_FILE_BYTES = 64 * 1024 * 1024  # rotate output files so no single JSONL grows without bound


MIN_SPLIT_DOCUMENTS = 2  # one held out, one trained on


def stable_unit(key: str) -> float:
    """Map a string to [0, 1) the same way on every machine and Python run.

    Used for every split by document id (tokenizer held-out, pack validation), so a document's
    split never depends on corpus order, and with the same hash the validation documents
    (val_fraction) are a subset of the tokenizer's held-out documents (heldout_fraction).
    """
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def choose_split_ids(corpus_dir: Path, fraction: float) -> set[str]:
    """Ids of the documents set aside (tokenizer held-out, pack validation).

    Those whose stable_unit(id) is below fraction, plus, for a source with at least two documents
    and none below it, its lowest-hash document: small corpora still measure every source. Both
    stages use this rule, so with val_fraction <= heldout_fraction every validation document is
    also one the tokenizer never saw.
    """
    chosen: set[str] = set()
    lowest: dict[str, tuple[float, str]] = {}
    counts: Counter = Counter()
    covered: set[str] = set()
    for doc in iter_documents(corpus_dir):
        u, source = stable_unit(doc["id"]), doc["source"]
        counts[source] += 1
        if u < fraction:
            chosen.add(doc["id"])
            covered.add(source)
        if source not in lowest or (u, doc["id"]) < lowest[source]:
            lowest[source] = (u, doc["id"])
    for source, n in counts.items():
        if n >= 2 and source not in covered:
            chosen.add(lowest[source][1])
    total = sum(counts.values())
    if not chosen or len(chosen) == total:
        # Nothing held out (every source has one document) or nothing left to train on: the
        # tokenizer could not be measured and pretraining would have no validation loss.
        raise DataError(
            f"{corpus_dir}: {total} document{'s' if total != 1 else ''} in {len(counts)} "
            f"source{'s' if len(counts) != 1 else ''}, too few to split: a corpus needs at least "
            f"{MIN_SPLIT_DOCUMENTS} documents of one source (one held out for validation, the rest to train on)"
        )
    return chosen


def widen_split(corpus_dir: Path, chosen: set[str], min_docs: int) -> set[str]:
    """`chosen` grown to min_docs documents (at most half the corpus) with the next documents in
    stable-hash order, the order val_fraction takes them in: a larger fraction would pick the same."""
    ranked = sorted((stable_unit(doc["id"]), doc["id"]) for doc in iter_documents(corpus_dir))
    target = min(min_docs, len(ranked) // 2)
    widened = set(chosen)
    for _, doc_id in ranked:
        if len(widened) >= target:
            break
        widened.add(doc_id)
    return widened


class Rejected(Exception):
    """A candidate file that cannot become a document; the message is the reason."""


@dataclass
class Candidate:
    key: str  # stable, source-relative name; becomes the document id prefix
    path: str  # where the text came from, for meta and rejected records
    load: Callable[[], str]  # reads and decodes the text; raises Rejected
    meta: dict


def decode_bytes(data: bytes) -> str:
    if b"\x00" in data:
        raise Rejected("binary (contains NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Rejected(f"not UTF-8 ({err.reason} at byte {err.start})") from None


def read_text_file(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            raise Rejected(f"bad gzip ({err})") from None
    return decode_bytes(data)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def walk_sorted(root: Path, skip_dirs: frozenset[str] = frozenset()) -> Iterator[Path]:
    """Every file under root in a sorted, machine-independent order (symlinked dirs not followed)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip_dirs)
        for name in sorted(files):
            yield Path(folder) / name


def python_stdlib_candidates() -> list[Candidate]:
    root = stdlib_root()
    return [
        Candidate(
            f"python_stdlib/{p.relative_to(root).as_posix()}",
            str(p),
            lambda p=p: read_text_file(p),
            {"license": PSF_LICENSE},
        )
        for p in walk_sorted(root, STDLIB_SKIP_DIRS)
        if p.suffix == ".py"
    ]


def module_docstrings(path: Path, module: str) -> str:
    """A pydoc-like text page of one module's docstrings, read from source without importing it."""
    try:
        tree = ast.parse(read_text_file(path))
    except SyntaxError as err:
        raise Rejected(f"cannot parse ({err.msg}, line {err.lineno})") from None
    parts = []
    doc = ast.get_docstring(tree)
    if doc:
        parts.append(f"Module {module}\n\n{doc}\n")

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and not node.name.startswith("_"):
                    parts.append(f"{prefix}{node.name}({ast.unparse(node.args)})\n{doc}\n")
            elif isinstance(node, ast.ClassDef):
                doc = ast.get_docstring(node)
                if doc and not node.name.startswith("_"):
                    parts.append(f"class {prefix}{node.name}\n{doc}\n")
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, f"{module}.")
    return "\n".join(parts)


def python_docs_candidates() -> list[Candidate]:
    from pydoc_data.topics import topics  # the reference-manual text pydoc shows for help("topic")

    out = [
        Candidate(
            f"python_docs/topics/{name}",
            f"pydoc_data.topics:{name}",
            lambda t=text: t,
            {"license": PSF_LICENSE, "kind": "reference_topic"},
        )
        for name, text in sorted(topics.items())
    ]
    root = stdlib_root()
    for p in walk_sorted(root, STDLIB_SKIP_DIRS):
        rel = p.relative_to(root)
        if p.suffix == ".py":
            module = ".".join(rel.with_suffix("").parts)
            module = module.removesuffix(".__init__")
            out.append(
                Candidate(
                    f"python_docs/docstrings/{module}",
                    str(p),
                    lambda p=p, m=module: module_docstrings(p, m),
                    {"license": PSF_LICENSE, "kind": "docstrings"},
                )
            )
        elif p.suffix in (".txt", ".rst"):
            out.append(
                Candidate(
                    f"python_docs/prose/{rel.as_posix()}",
                    str(p),
                    lambda p=p: read_text_file(p),
                    {"license": PSF_LICENSE, "kind": "prose"},
                )
            )
    return out


def is_debian_doc(name: str) -> bool:
    base = name.lower().removesuffix(".gz")
    return base.startswith(DEBIAN_NAMES) or base.endswith(DEBIAN_SUFFIXES)


def debian_docs_candidates() -> list[Candidate]:
    root = DEBIAN_DOC_ROOT
    if not root.is_dir():
        return []
    out, seen = [], set()
    for p in walk_sorted(root):
        if not is_debian_doc(p.name) or not p.is_file():
            continue
        real = os.path.realpath(p)  # many packages symlink their docs to another package's
        if real in seen:
            continue
        seen.add(real)
        rel = p.relative_to(root)
        package = rel.parts[0]
        out.append(
            Candidate(
                f"debian_docs/{rel.as_posix()}",
                str(p),
                lambda p=p: read_text_file(p),
                {"license": f"see {root / package / 'copyright'}", "package": package},
            )
        )
    return out


SOURCES: dict[str, Callable[[], list[Candidate]]] = {
    "python_stdlib": python_stdlib_candidates,
    "python_docs": python_docs_candidates,
    "debian_docs": debian_docs_candidates,
}


def split_document(text: str, max_chars: int) -> list[str]:
    """Cut text into pieces of at most max_chars, at the last line break that fits.

    A single line longer than max_chars is cut mid-line, since nothing better exists.
    """
    pieces, start = [], 0
    while len(text) - start > max_chars:
        end = text.rfind("\n", start, start + max_chars)
        end = start + max_chars if end <= start else end + 1  # keep the newline with its line
        pieces.append(text[start:end])
        start = end
    pieces.append(text[start:])
    return pieces


class CorpusWriter:
    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.index = 0
        self.file = None
        self.file_bytes = 0

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if self.file is None or self.file_bytes >= DOCS_FILE_BYTES:
            self.close()
            self.file = open(self.out_dir / f"docs-{self.index:05d}.jsonl", "w", encoding="utf-8")
            self.index += 1
            self.file_bytes = 0
        self.file.write(line)
        self.file_bytes += len(line)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def collect_source(name: str, cfg: CorpusConfig, write: Callable[[dict], None], reject: Callable[[dict], None]) -> dict:
    """Read one source's candidates in a seeded order until its byte cap is reached."""
    candidates = SOURCES[name]()
    # Sorted then shuffled with a seed derived from (seed, source): the same machine files give the
    # same corpus, and a different seed samples a different subset when the cap bites.
    candidates.sort(key=lambda c: c.key)
    random.Random(f"{cfg.seed}/{name}").shuffle(candidates)
    stats = Counter(
        {key: 0 for key in ("candidates", "files_read", "files_not_read_cap", "documents", "bytes", "truncated_at_cap")}
    )
    reasons: Counter = Counter()
    seen_text: dict[str, str] = {}
    budget = cfg.max_bytes_per_source
    stats["candidates"] = len(candidates)
    for cand in candidates:
        if budget < cfg.min_chars:
            break
        stats["files_read"] += 1
        try:
            text = cand.load()
        except Rejected as err:
            reasons[str(err).split(" (")[0]] += 1
            reject({"step": "corpus", "source": name, "path": cand.path, "reason": str(err)})
            continue
        pieces = split_document(text, cfg.max_chars)
        for k, piece in enumerate(pieces):
            doc_id = f"{cand.key}#{k}"
            if len(piece) < cfg.min_chars:
                reasons["shorter than min_chars"] += 1
                reject(
                    {
                        "step": "corpus",
                        "source": name,
                        "path": cand.path,
                        "id": doc_id,
                        "reason": f"shorter than min_chars={cfg.min_chars}",
                        "text": piece,
                    }
                )
                continue
            # Identical texts (packages built from one source ship the same copyright file and
            # changelog) would be memorised and leak across the validation split; keep one copy.
            digest = hashlib.sha1(piece.encode("utf-8")).hexdigest()
            if digest in seen_text:
                reasons["exact duplicate"] += 1
                reject(
                    {
                        "step": "corpus",
                        "source": name,
                        "path": cand.path,
                        "id": doc_id,
                        "reason": f"exact duplicate of {seen_text[digest]}",
                    }
                )
                continue
            size = len(piece.encode("utf-8"))
            if size > budget:
                # Trim the last document at a line boundary so the cap is met exactly, not overshot.
                piece = piece.encode("utf-8")[:budget].decode("utf-8", errors="ignore")
                cut = piece.rfind("\n")
                piece = piece[: cut + 1] if cut > 0 else piece
                size = len(piece.encode("utf-8"))
                if len(piece) < cfg.min_chars:
                    budget = 0
                    break
                stats["truncated_at_cap"] += 1
            seen_text[digest] = doc_id
            meta = {"path": cand.path, "part": k, "parts": len(pieces), **cand.meta}
            write({"id": doc_id, "text": piece, "source": name, "meta": meta})
            stats["documents"] += 1
            stats["bytes"] += size
            budget -= size
            if budget < cfg.min_chars:
                break
    stats["files_not_read_cap"] = stats["candidates"] - stats["files_read"]
    out = dict(sorted(stats.items()))
    out["dropped"] = dict(sorted(reasons.items()))
    if not candidates:
        out["note"] = f"no files found for {name}" + (f" under {DEBIAN_DOC_ROOT}" if name == "debian_docs" else "")
    return out


def build_corpus(cfg: CorpusConfig, out_dir: Path) -> dict:
    cfg.validate()
    started = time.perf_counter()
    out_dir = Path(out_dir)
    (out_dir / "rejected").mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("docs-*.jsonl"):  # a rerun must not leave a previous run's files behind
        old.unlink()
    writer = CorpusWriter(out_dir)
    per_source = {}
    with open(out_dir / "rejected" / "rejected.jsonl", "w", encoding="utf-8") as rejected:

        def reject(record: dict) -> None:
            rejected.write(json.dumps(record, ensure_ascii=False) + "\n")

        try:
            for name in cfg.sources:
                t0 = time.perf_counter()
                per_source[name] = collect_source(name, cfg, writer.write, reject)
                per_source[name]["seconds"] = round(time.perf_counter() - t0, 3)
        finally:
            writer.close()
    stats = {
        "documents": sum(s.get("documents", 0) for s in per_source.values()),
        "bytes": sum(s.get("bytes", 0) for s in per_source.values()),
        "files": writer.index,
        "sources": per_source,
        "seconds": round(time.perf_counter() - started, 3),
    }
    if stats["documents"] == 0:
        raise DataError(
            f"{out_dir}: no documents were collected from sources {cfg.sources}; "
            f"see {out_dir / 'rejected' / 'rejected.jsonl'}"
        )
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def iter_documents(corpus_dir: Path) -> Iterator[dict]:
    """Yield the records of every ``*.jsonl`` file directly in corpus_dir, in file-name order.

    Any JSONL with ``id``/``text``/``source`` fields works, so users can bring their own documents.
    """
    corpus_dir = Path(corpus_dir)
    files = sorted(corpus_dir.glob("*.jsonl")) if corpus_dir.is_dir() else []
    if not files:
        raise DataError(f"{corpus_dir}: no *.jsonl document files (run the corpus stage first)")
    for path in files:
        for number, record in strict_records(path):
            for key in ("id", "text", "source"):
                if not isinstance(record.get(key), str):
                    raise DataError(f"{path}:{number}: field {key!r} missing or not a string")
            record.setdefault("meta", {})
            yield record
