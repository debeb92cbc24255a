"""Tokenize a corpus into flat token shards per source and split, plus the mixture weights.

Layout (read by kiln.data.loader.TokenLoader):

    out_dir/train/<source>-00000.bin   little-endian uint16 (uint32 if the vocab exceeds 65536),
    out_dir/train/<source>-00000.json  each document's tokens followed by <|endoftext|>
    out_dir/val/...                    same, for the validation documents
    out_dir/mixture.json               {"vocab_size", "tokenizer_sha256", "weights": {source: w}}
    out_dir/stats.json                 written last; a remote pack is published with it last
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np

from kiln.data.config import PackConfig
from kiln.data.corpus import choose_split_ids, iter_documents, widen_split
from kiln.data.tokenizer import Tokenizer, count_documents
from kiln.errors import ConfigError, DataError
from kiln.files import publishing, write_text_atomic
from kiln.progress import progress, progress_visible
from kiln.storage import staged_output

SPLITS = ("train", "val")
# Documents per encode_batch call: big enough to keep the Rust thread pool busy, small enough
# that a chunk's token lists stay a few tens of MB.
ENCODE_CHUNK_BYTES = 4_000_000


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned type that holds every token id."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def dtype_name(dtype: np.dtype) -> str:
    return {np.dtype("<u2"): "uint16", np.dtype("<u4"): "uint32"}[np.dtype(dtype)]


def write_shard(bin_path: Path, tokens: np.ndarray, header: dict) -> None:
    """Write tokens to bin_path and its header next to it (.json), header last: a shard whose
    header exists is complete."""
    dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[header["dtype"]])
    # A file write, not ndarray.tofile: that reports a full disk with no errno.
    data = memoryview(np.ascontiguousarray(tokens, dtype=dtype))
    with publishing(bin_path) as tmp, open(tmp, "wb") as f:
        f.write(data)
    # sha256: a copy of the shard (a remote pack's local cache, kiln.data.remote_pack) is checked against it.
    header = {**header, "tokens": int(len(tokens)), "sha256": hashlib.sha256(data).hexdigest()}
    write_text_atomic(bin_path.with_suffix(".json"), json.dumps(header, indent=2) + "\n")


class ShardWriter:
    """Accumulates one (split, source) token stream and writes it as shard files.

    Documents are never cut across shards, so each header's document count is exact; a shard
    exceeds shard_tokens only when a single document alone does.
    """

    def __init__(self, folder: Path, source: str, shard_tokens: int, base_header: dict):
        self.folder = folder
        self.source = source
        self.shard_tokens = shard_tokens
        self.base_header = base_header
        self.dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[base_header["dtype"]])
        self.parts: list[np.ndarray] = []
        self.buffered = 0
        self.documents = 0
        self.bytes = 0
        self.shards = 0
        self.totals = {"documents": 0, "tokens": 0, "bytes": 0, "shards": 0}

    def add(self, ids: list[int], n_bytes: int) -> None:
        if self.buffered and self.buffered + len(ids) > self.shard_tokens:
            self.flush()
        self.parts.append(np.asarray(ids, dtype=self.dtype))
        self.buffered += len(ids)
        self.documents += 1
        self.bytes += n_bytes

    def flush(self) -> None:
        if not self.buffered:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self.source}-{self.shards:05d}.bin"
        header = {**self.base_header, "documents": self.documents, "bytes": self.bytes, "source": self.source}
        write_shard(path, np.concatenate(self.parts), header)
        for key, value in (("documents", self.documents), ("tokens", self.buffered), ("bytes", self.bytes)):
            self.totals[key] += value
        self.shards += 1
        self.totals["shards"] = self.shards
        self.parts, self.buffered, self.documents, self.bytes = [], 0, 0, 0


def mixture_weights(cfg: PackConfig, train_tokens: dict[str, int]) -> dict[str, float]:
    """cfg.mixture normalised (sources it leaves out get 0), or each source's share of tokens."""
    if cfg.mixture:
        for name, weight in cfg.mixture.items():
            if name not in train_tokens:
                raise ConfigError(
                    f"mixture.{name}", f"no such source in the corpus; sources: {', '.join(sorted(train_tokens))}"
                )
            if weight > 0 and train_tokens[name] == 0:
                raise ConfigError(f"mixture.{name}", "source has no training tokens to draw from")
        raw = {name: float(cfg.mixture.get(name, 0.0)) for name in sorted(train_tokens)}
    else:
        raw = {name: float(n) for name, n in sorted(train_tokens.items())}
    total = sum(raw.values())
    if total <= 0:
        raise DataError("no training tokens in any source")
    return {name: w / total for name, w in raw.items()}


def pack(corpus_dir: Path, tokenizer_path: Path, cfg: PackConfig, out_dir: Path | str) -> dict:
    """Pack `corpus_dir` into `out_dir`; an fsspec URL `out_dir` is written locally and uploaded
    with stats.json last (kiln.storage.staged_output), the marker kiln.data.remote_pack reads."""
    with staged_output(out_dir, "stats.json") as local:
        return pack_local(corpus_dir, tokenizer_path, cfg, local)


def pack_local(corpus_dir: Path, tokenizer_path: Path, cfg: PackConfig, out_dir: Path) -> dict:
    cfg.validate()
    started = time.perf_counter()
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    tok = Tokenizer.load(tokenizer_path)
    dtype = token_dtype(tok.vocab_size)
    base_header = {"dtype": dtype_name(dtype), "vocab_size": tok.vocab_size, "tokenizer_sha256": tok.sha256}
    val_ids = choose_split_ids(corpus_dir, cfg.val_fraction)
    if len(val_ids) < cfg.min_val_docs:
        chosen = len(val_ids)
        val_ids = widen_split(corpus_dir, val_ids, cfg.min_val_docs)
        print(
            f"warning: pack.val_fraction={cfg.val_fraction} holds out {chosen} document{'s' if chosen != 1 else ''}; "
            f"validating on {len(val_ids)} (pack.min_val_docs={cfg.min_val_docs}, at most half the corpus). "
            "A small validation split gives a noisy loss: add documents or raise pack.val_fraction"
        )
    for split in SPLITS:  # a rerun must not leave a previous run's shards behind
        shutil.rmtree(out_dir / split, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    writers: dict[tuple[str, str], ShardWriter] = {}
    sources: set[str] = set()

    def writer(split: str, source: str) -> ShardWriter:
        if (split, source) not in writers:
            writers[split, source] = ShardWriter(out_dir / split, source, cfg.shard_tokens, base_header)
        return writers[split, source]

    total = count_documents(corpus_dir) if progress_visible() else None
    bar = progress(total=total, desc="[pack] tokenize", unit="doc")
    tokens = 0

    def encode_chunk(docs: list[dict]) -> None:
        nonlocal tokens
        texts = [d["text"] for d in docs]
        # parse_special=False: a document that happens to contain "<|endoftext|>" stays plain text.
        for doc, text, ids in zip(docs, texts, tok.encode_batch(texts, parse_special=False)):
            ids.append(tok.eot_id)
            tokens += len(ids)
            split = "val" if doc["id"] in val_ids else "train"
            writer(split, doc["source"]).add(ids, len(text.encode("utf-8")))
        bar.set_postfix(tokens=f"{tokens:,}", refresh=False)  # drawn by the update below
        bar.update(len(docs))

    chunk, chunk_bytes = [], 0
    for doc in iter_documents(corpus_dir):
        if "/" in doc["source"] or doc["source"] in ("", ".", ".."):
            raise DataError(
                f"{corpus_dir}: document {doc['id']!r} has source {doc['source']!r}, which cannot name a shard file"
            )
        sources.add(doc["source"])
        chunk.append(doc)
        chunk_bytes += len(doc["text"])
        if chunk_bytes >= ENCODE_CHUNK_BYTES:
            encode_chunk(chunk)
            chunk, chunk_bytes = [], 0
    encode_chunk(chunk)
    bar.close()
    for w in writers.values():
        w.flush()

    per_source = {}
    for source in sorted(sources):
        per_source[source] = {
            split: writers[split, source].totals
            if (split, source) in writers
            else {"documents": 0, "tokens": 0, "bytes": 0, "shards": 0}
            for split in SPLITS
        }
    weights = mixture_weights(cfg, {s: per_source[s]["train"]["tokens"] for s in per_source})
    mixture = {**{k: base_header[k] for k in ("vocab_size", "tokenizer_sha256")}, "weights": weights}
    write_text_atomic(out_dir / "mixture.json", json.dumps(mixture, indent=2) + "\n")

    seconds = time.perf_counter() - started
    totals = {
        split: {key: sum(per_source[s][split][key] for s in per_source) for key in ("documents", "tokens", "bytes")}
        for split in SPLITS
    }
    stats = {
        **base_header,
        "train": totals["train"],
        "val": totals["val"],
        "sources": per_source,
        "weights": weights,
        "seconds": round(seconds, 3),
        "tokens_per_second": round((totals["train"]["tokens"] + totals["val"]["tokens"]) / max(seconds, 1e-9)),
    }
    write_text_atomic(out_dir / "stats.json", json.dumps(stats, indent=2) + "\n")
    return stats
