"""Whole-dataset deduplication steps: exact, line/paragraph, MinHash-LSH and SimHash.

Each runs in the executor's three phases and talks through files in its `workdir`, so no process
ever holds the dataset's text:

1. `index` (per task): hash the task's documents into small numpy arrays
   (`task-00003.key-007.npy` = band 7's 64-bit keys), plus the task's ids and document count.
2. `resolve` (once): for one band (or bucket) at a time, read that band from every task, link the
   documents that share a key, and union them. Memory is one band's keys (16 bytes per document)
   plus the union-find (8 bytes per document). Every cluster keeps its smallest member in input
   order (task 0 first, then position within the task) and the rest are written to
   `task-00003.drop.json` with the id of the document they duplicate.
3. `load` + `reason` (per task): drop the listed documents, recording `meta["duplicate_of"]`.

Documents are matched between `index` and `reason` by (id, occurrence of that id in the task), so
repeated ids in the input are still told apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterable, Iterator

import numpy as np

from kiln.data import minhash
from kiln.data.steps.base import Deduplicator, register
from kiln.errors import ConfigError

INDEX_BATCH_DOCS = 2048  # documents hashed per vectorised batch: big enough to amortise numpy calls


def normalize_for_hash(text: str) -> str:
    """Lowercase with every whitespace run collapsed to one space: what "the same text" means."""
    return " ".join(text.lower().split())


def hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def _save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def _save_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _task(workdir: Path, task: int, what: str) -> Path:
    return workdir / f"task-{task:05d}.{what}"


def _occurrences(ids: list[str]) -> list[int]:
    seen: Counter = Counter()
    out = []
    for i in ids:
        out.append(seen[i])
        seen[i] += 1
    return out


def _batches(docs: Iterable[dict], size: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _positive(step, *names: str) -> None:
    for name in names:
        if getattr(step, name) < 1:
            raise ConfigError(name, f"must be >= 1, got {getattr(step, name)}")


@dataclass
class _ClusterDedup(Deduplicator):
    """Shared machinery: documents linked by equal keys are clustered; one per cluster survives."""

    drop_reason: ClassVar[str] = ""

    def keys(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(rows of `texts` that take part, their keys [rows, n_keys] uint64)."""
        raise NotImplementedError

    def index(self, docs: Iterable[dict], workdir: Path, task: int) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        ids: list[str] = []
        rows, keys = [], []
        for batch in _batches(docs, INDEX_BATCH_DOCS):
            r, k = self.keys([d["text"] for d in batch])
            rows.append(r + len(ids))
            keys.append(k)
            ids.extend(d["id"] for d in batch)
        rows_all = np.concatenate(rows) if rows else np.empty(0, np.int64)
        keys_all = np.concatenate(keys) if keys else np.empty((0, self.n_keys()), np.uint64)
        for band in range(keys_all.shape[1]):
            _save(_task(workdir, task, f"key-{band:03d}.npy"), np.ascontiguousarray(keys_all[:, band]))
        _save(_task(workdir, task, "rows.npy"), rows_all.astype(np.int64))
        self._save_ids(workdir, task, ids)

    def n_keys(self) -> int:
        return 1

    def _save_ids(self, workdir: Path, task: int, ids: list[str]) -> None:
        _save_json(_task(workdir, task, "ids.json"), ids)
        _save_json(_task(workdir, task, "count.json"), len(ids))

    def edges(self, workdir: Path, n_tasks: int, offsets: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Candidate pairs of global document numbers, one band at a time."""
        rows = [np.load(_task(workdir, t, "rows.npy")) + offsets[t] for t in range(n_tasks)]
        global_rows = np.concatenate(rows)
        for band in range(self.n_keys()):
            keys = np.concatenate([np.load(_task(workdir, t, f"key-{band:03d}.npy")) for t in range(n_tasks)])
            yield minhash.bucket_edges(keys, global_rows)

    def resolve(self, workdir: Path, n_tasks: int) -> dict:
        counts = [json.loads(_task(workdir, t, "count.json").read_text()) for t in range(n_tasks)]
        offsets = np.zeros(n_tasks + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        clusters = minhash.UnionFind(int(offsets[-1]))
        candidate_pairs = 0
        for u, v in self.edges(workdir, n_tasks, offsets):
            candidate_pairs += int(u.size)
            clusters.union(u, v)
        roots = clusters.roots()
        dropped = np.flatnonzero(roots != np.arange(roots.size))
        keepers = roots[dropped]
        # Map the kept documents' numbers back to ids, reading each task's id list once.
        keeper_task = np.searchsorted(offsets, keepers, side="right") - 1
        keeper_id: dict[int, str] = {}
        drop_task = np.searchsorted(offsets, dropped, side="right") - 1
        for t in range(n_tasks):
            need = keepers[keeper_task == t]
            if need.size == 0:
                continue
            ids = json.loads(_task(workdir, t, "ids.json").read_text())
            for g in np.unique(need):
                keeper_id[int(g)] = ids[int(g - offsets[t])]
        for t in range(n_tasks):
            mine = np.flatnonzero(drop_task == t)
            records = []
            if mine.size:
                ids = json.loads(_task(workdir, t, "ids.json").read_text())
                occurrence = _occurrences(ids)
            for j in mine:
                local = int(dropped[j] - offsets[t])
                records.append([ids[local], occurrence[local], keeper_id[int(keepers[j])]])
            _save_json(_task(workdir, t, "drop.json"), records)
        cluster_sizes = np.bincount(roots)
        return {
            "documents": int(roots.size),
            "duplicates": int(dropped.size),
            "clusters_with_duplicates": int(np.count_nonzero(cluster_sizes > 1)),
            "candidate_pairs": candidate_pairs,
        }

    def load(self, workdir: Path, task: int) -> None:
        records = json.loads(_task(workdir, task, "drop.json").read_text())
        self._drop = {(doc_id, occ): kept for doc_id, occ, kept in records}
        self._seen: Counter = Counter()

    def reason(self, doc: dict) -> str | None:
        occurrence = self._seen[doc["id"]]
        self._seen[doc["id"]] += 1
        kept = self._drop.get((doc["id"], occurrence))
        if kept is None:
            return None
        doc["meta"]["duplicate_of"] = kept
        return self.drop_reason


@register
@dataclass
class ExactDedup(_ClusterDedup):
    """Drops documents whose text equals an earlier one's after lowercasing and collapsing whitespace."""

    name = "exact_dedup"
    drop_reason = "exact_duplicate"

    def keys(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        rows, keys = [], []
        for i, text in enumerate(texts):
            norm = normalize_for_hash(text)
            if norm:  # empty texts are not "duplicates" of each other; empty-text filters handle them
                rows.append(i)
                keys.append(hash64(norm))
        return np.array(rows, dtype=np.int64), np.array(keys, dtype=np.uint64).reshape(-1, 1)


@register
@dataclass
class MinhashDedup(_ClusterDedup):
    """Fuzzy dedup: MinHash over token n-gram shingles, LSH bands, union-find clusters.

    Defaults are FineWeb's (datatrove's): 5-gram shingles, 112 permutations as 14 bands of 8 rows,
    which catches pairs at Jaccard 0.7 / 0.8 / 0.9 with probability 0.56 / 0.92 / 1.00.
    """

    name = "minhash_dedup"
    drop_reason = "minhash_duplicate"
    ngram: int = minhash.NGRAM
    num_perm: int = minhash.NUM_PERM
    bands: int = minhash.BANDS
    rows: int = minhash.ROWS
    seed: int = minhash.SEED

    def validate(self) -> None:
        _positive(self, "ngram", "num_perm", "bands", "rows")
        if self.ngram > 10:
            raise ConfigError("ngram", f"must be <= 10, got {self.ngram}")
        if self.bands * self.rows != self.num_perm:
            raise ConfigError(
                "bands",
                f"bands * rows = {self.bands} * {self.rows} = "
                f"{self.bands * self.rows} must equal num_perm = {self.num_perm}",
            )

    def n_keys(self) -> int:
        return self.bands

    def keys(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        shingles, offsets = minhash.shingle_hashes(texts, self.ngram)
        rows = np.flatnonzero(np.diff(offsets) > 0)  # no tokens: nothing to compare
        sigs = minhash.signatures(minhash.shingle_hashes32(shingles), offsets, self.num_perm, self.seed)
        return rows, minhash.band_keys(sigs[rows], self.bands, self.rows)


@register
@dataclass
class SimhashDedup(_ClusterDedup):
    """Fuzzy dedup: 64-bit SimHash of token 3-grams; documents within `max_distance` bits cluster.

    Candidate pairs come from block tables (Manku et al. 2007), not all pairs: `blocks` must exceed
    `max_distance`. Resolve holds every fingerprint (8 bytes per document) at once.
    """

    name = "simhash_dedup"
    drop_reason = "simhash_duplicate"
    ngram: int = 3
    max_distance: int = 3
    blocks: int = 4

    def validate(self) -> None:
        _positive(self, "ngram", "blocks")
        if self.ngram > 10:
            raise ConfigError("ngram", f"must be <= 10, got {self.ngram}")
        if not 0 <= self.max_distance < 64:
            raise ConfigError("max_distance", f"must be in 0..63, got {self.max_distance}")
        if not self.max_distance < self.blocks <= 64:
            raise ConfigError("blocks", f"must be > max_distance ({self.max_distance}) and <= 64, got {self.blocks}")

    def keys(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        fingerprints = minhash.simhash_fingerprints(texts, self.ngram)
        rows = np.flatnonzero(np.array([bool(normalize_for_hash(t)) for t in texts], dtype=bool))
        return rows, fingerprints[rows].reshape(-1, 1)

    def edges(self, workdir: Path, n_tasks: int, offsets: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        rows = np.concatenate([np.load(_task(workdir, t, "rows.npy")) + offsets[t] for t in range(n_tasks)])
        fps = np.concatenate([np.load(_task(workdir, t, "key-000.npy")) for t in range(n_tasks)])
        yield minhash.simhash_edges(fps, rows, self.max_distance, self.blocks)


_PARAGRAPH_BREAK = re.compile(r"(\n[ \t\r\f\v]*\n\s*)")


def split_units(text: str, unit: str) -> list[tuple[str, str]]:
    """(content, trailing separator) pieces whose concatenation is `text`."""
    if unit == "line":
        out = []
        for line in text.splitlines(keepends=True):
            content = line.rstrip("\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
            out.append((content, line[len(content) :]))
        return out
    parts = _PARAGRAPH_BREAK.split(text)
    parts.append("")
    return [(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]


@register
@dataclass
class LineDedup(Deduplicator):
    """Removes lines (or paragraphs) that appear in more than one document, keeping the first.

    A line counts as seen when its normalised text (lowercase, whitespace collapsed) occurs in an
    earlier document in input order; that earlier document keeps it, every later document loses it.
    Repeats inside one document are left to the repetition filters. Lines shorter than `min_chars`
    (after normalising; blank lines always) are never removed: short lines such as "}" or "Thanks!"
    repeat across unrelated documents. A document left with no text is dropped ("line_dedup_empty").
    Resolve works one hash bucket at a time (`buckets` files per task), so memory is
    ~16 bytes x (distinct lines per document, summed) / buckets.
    """

    name = "line_dedup"
    unit: str = "line"
    min_chars: int = 0
    buckets: int = 16

    def validate(self) -> None:
        if self.unit not in ("line", "paragraph"):
            raise ConfigError("unit", f"must be 'line' or 'paragraph', got {self.unit!r}")
        if self.min_chars < 0:
            raise ConfigError("min_chars", f"must be >= 0, got {self.min_chars}")
        _positive(self, "buckets")

    def _unit_hash(self, content: str) -> int | None:
        norm = normalize_for_hash(content)
        if not norm or len(norm) < self.min_chars:
            return None
        return hash64(norm)

    def index(self, docs: Iterable[dict], workdir: Path, task: int) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        ids: list[str] = []
        hashes: list[int] = []
        owners: list[int] = []
        for doc in docs:
            unique = {
                h for content, _ in split_units(doc["text"], self.unit) if (h := self._unit_hash(content)) is not None
            }
            hashes.extend(unique)
            owners.extend([len(ids)] * len(unique))
            ids.append(doc["id"])
        h = np.array(hashes, dtype=np.uint64)
        o = np.array(owners, dtype=np.int64)
        bucket = h % np.uint64(self.buckets)
        for b in range(self.buckets):
            mask = bucket == b
            _save(_task(workdir, task, f"lines-{b:03d}.npy"), np.stack([h[mask].view(np.int64), o[mask]]))
        _save_json(_task(workdir, task, "ids.json"), ids)
        _save_json(_task(workdir, task, "count.json"), len(ids))

    def resolve(self, workdir: Path, n_tasks: int) -> dict:
        counts = [json.loads(_task(workdir, t, "count.json").read_text()) for t in range(n_tasks)]
        offsets = np.zeros(n_tasks + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        indexed = removed = 0
        touched = set()
        for b in range(self.buckets):
            parts = [np.load(_task(workdir, t, f"lines-{b:03d}.npy")) for t in range(n_tasks)]
            h = np.concatenate([p[0] for p in parts])
            doc = np.concatenate([p[1] + offsets[t] for t, p in enumerate(parts)])
            indexed += h.size
            order = np.lexsort((doc, h))
            h, doc = h[order], doc[order]
            first = np.ones(h.size, dtype=bool)
            first[1:] = h[1:] != h[:-1]
            later = ~first  # same line, a later document (each document lists a line once)
            h, doc = h[later], doc[later]
            removed += h.size
            touched.update(np.unique(doc).tolist())
            task_of = np.searchsorted(offsets, doc, side="right") - 1
            for t in range(n_tasks):
                mine = task_of == t
                _save(_task(workdir, t, f"remove-{b:03d}.npy"), np.stack([h[mine], doc[mine] - offsets[t]]))
        return {
            "documents": int(offsets[-1]),
            "units_indexed": int(indexed),
            "units_removed": int(removed),
            "documents_edited": len(touched),
        }

    def load(self, workdir: Path, task: int) -> None:
        ids = json.loads(_task(workdir, task, "ids.json").read_text())
        occurrence = _occurrences(ids)
        remove: dict[tuple[str, int], set[int]] = defaultdict(set)
        for b in range(self.buckets):
            h, local = np.load(_task(workdir, task, f"remove-{b:03d}.npy"))
            for hv, lv in zip(h.view(np.uint64).tolist(), local.tolist()):
                remove[(ids[lv], occurrence[lv])].add(hv)
        self._remove = dict(remove)
        self._seen: Counter = Counter()

    def reason(self, doc: dict) -> str | None:
        occurrence = self._seen[doc["id"]]
        self._seen[doc["id"]] += 1
        gone = self._remove.get((doc["id"], occurrence))
        if not gone:
            return None
        kept, n_removed, chars_removed = [], 0, 0
        for content, sep in split_units(doc["text"], self.unit):
            if self._unit_hash(content) in gone:
                n_removed += 1
                chars_removed += len(content)
            else:
                kept.append(content + sep)
        doc["text"] = "".join(kept)
        doc["meta"]["line_dedup_removed"] = n_removed
        self.stats.count("units_removed", n_removed)
        self.stats.count("chars_removed", chars_removed)
        if not doc["text"].strip():
            return "line_dedup_empty"
        return None
