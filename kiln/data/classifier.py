"""A document quality classifier that Kiln trains itself: hashed n-grams and logistic regression.

The idea is the one behind GPT-3's and DCLM's quality filters: a linear model learns to tell a
reference set (positive: text we want more of, e.g. documentation or curated prose) from raw input
(negative), and its probability of "reference-like" ranks the raw documents. Nothing here needs a
download or a GPU: features are hashed, the model is one weight vector, training is numpy.

Features of a text (all counted, then log-scaled and L2-normalised):
- lowercased words from `kiln.data.steps.text.words` (so Chinese splits into character-words) as
  unigrams and bigrams;
- for CJK text, also character 3-grams (word 3-grams over the character-words), because a single
  Han character says little and bigrams alone miss most Chinese words and phrases.
Each feature string is hashed with CRC-32 into `buckets` slots (the hashing trick); another bit of
the same hash gives a sign, so colliding features cancel on average instead of piling up.

Files: `<name>.safetensors` (`weight` [buckets] float32, `bias` [1] float32) and `<name>.json`
beside it (feature config, training stats), so a model is inspectable without Kiln.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from kiln.data.readers import list_named_inputs, read_documents
from kiln.data.steps.text import is_cjk, split_words
from kiln.errors import ConfigError, DataError

FORMAT = "kiln-quality-classifier"
VERSION = 1
SCORE_BATCH = 1024  # texts featurised at once when scoring; bounds memory on large shards


@dataclass
class FeatureConfig:
    buckets: int = 2**18  # 262k slots: collisions stay rare for a few hundred thousand distinct n-grams
    word_ngrams: int = 2  # unigrams and bigrams
    cjk_char_ngram: int = 3  # extra character n-grams for CJK text; 0 disables

    def validate(self) -> None:
        if self.buckets < 2 or self.buckets & (self.buckets - 1):
            raise ConfigError("buckets", f"must be a power of two >= 2, got {self.buckets}")
        if self.buckets > 2**31:
            raise ConfigError(
                "buckets", f"must be <= 2**31 (the hash has 32 bits, one of them the sign), got {self.buckets}"
            )
        if self.word_ngrams < 1:
            raise ConfigError("word_ngrams", f"must be >= 1, got {self.word_ngrams}")
        if self.cjk_char_ngram < 0:
            raise ConfigError("cjk_char_ngram", f"must be >= 0, got {self.cjk_char_ngram}")


def feature_strings(text: str, cfg: FeatureConfig, lang: str | None = None) -> list[str]:
    """The n-gram strings of one text; the n-gram order prefixes each so "a b" (bigram) and a
    unigram containing a space can never share a string."""
    cjk = is_cjk(text, lang)
    toks = [w.lower() for w in split_words(text, cjk)]
    feats = []
    for n in range(1, cfg.word_ngrams + 1):
        feats.extend(f"{n}\x1f" + "\x1f".join(toks[i : i + n]) for i in range(len(toks) - n + 1))
    if cjk and cfg.cjk_char_ngram > cfg.word_ngrams:
        n = cfg.cjk_char_ngram
        feats.extend("c\x1f" + "".join(toks[i : i + n]) for i in range(len(toks) - n + 1))
    return feats


def featurize(text: str, cfg: FeatureConfig, lang: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sparse feature vector of one text: (sorted bucket indices int64, values float32), L2 norm 1
    (empty arrays for a text without words)."""
    feats = feature_strings(text, cfg, lang)
    if not feats:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    h = np.fromiter((zlib.crc32(f.encode("utf-8")) for f in feats), dtype=np.uint64, count=len(feats))
    # Low bits pick the bucket, the top bit (unused by any bucket count <= 2**31) the sign.
    buckets = (h & np.uint64(cfg.buckets - 1)).astype(np.int64)
    signs = np.where(h >> np.uint64(31), -1.0, 1.0)
    idx, inverse = np.unique(buckets, return_inverse=True)
    counts = np.bincount(inverse, weights=signs, minlength=idx.size)
    # log(1 + tf): a word repeated 100 times is stronger evidence than once, but not 100x stronger;
    # without damping, repeated-token spam would dominate its own vector.
    vals = np.sign(counts) * np.log1p(np.abs(counts))
    keep = vals != 0  # colliding opposite signs cancel exactly
    idx, vals = idx[keep], vals[keep]
    norm = np.sqrt(np.sum(vals * vals))
    if norm > 0:
        vals = vals / norm
    return idx, vals.astype(np.float32)


@dataclass
class SparseBatch:
    """Rows of sparse vectors in CSR form: row r is indices/values[indptr[r]:indptr[r+1]]."""

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray

    @property
    def rows(self) -> int:
        return self.indptr.size - 1

    @classmethod
    def stack(cls, vectors: Sequence[tuple[np.ndarray, np.ndarray]]) -> "SparseBatch":
        lengths = np.fromiter((v[0].size for v in vectors), dtype=np.int64, count=len(vectors))
        indptr = np.zeros(len(vectors) + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        if not vectors:
            return cls(indptr, np.empty(0, np.int64), np.empty(0, np.float32))
        return cls(indptr, np.concatenate([v[0] for v in vectors]), np.concatenate([v[1] for v in vectors]))

    def row_ids(self) -> np.ndarray:
        return np.repeat(np.arange(self.rows), np.diff(self.indptr))

    def dot(self, weight: np.ndarray) -> np.ndarray:
        return np.bincount(self.row_ids(), weights=weight[self.indices] * self.values, minlength=self.rows)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # the tanh form cannot overflow for large |z|


class QualityClassifier:
    """Logistic regression over hashed n-grams; `score` is P(reference-like | text)."""

    def __init__(self, weight: np.ndarray, bias: float, features: FeatureConfig, stats: dict | None = None):
        if weight.shape != (features.buckets,):
            raise ValueError(f"weight has shape {weight.shape}, expected ({features.buckets},)")
        self.weight = weight.astype(np.float32)
        self.bias = float(np.float32(bias))  # as stored, so a saved and reloaded model scores identically
        self.features = features
        self.stats = stats or {}

    def vectors(self, texts: Iterable[str], langs: Iterable[str | None] | None = None) -> SparseBatch:
        texts = list(texts)
        langs = list(langs) if langs is not None else [None] * len(texts)
        return SparseBatch.stack([featurize(t, self.features, lang) for t, lang in zip(texts, langs)])

    def score(self, texts: Iterable[str], langs: Iterable[str | None] | None = None) -> np.ndarray:
        """float32 probabilities, one per text, in order; `langs` (e.g. meta["lang"]) picks the word split."""
        texts = list(texts)
        langs = list(langs) if langs is not None else [None] * len(texts)
        out = np.empty(len(texts), dtype=np.float32)
        for start in range(0, len(texts), SCORE_BATCH):
            end = start + SCORE_BATCH
            batch = self.vectors(texts[start:end], langs[start:end])
            out[start : start + batch.rows] = _sigmoid(batch.dot(self.weight) + self.bias)
        return out

    def save(self, path: str | Path) -> Path:
        """Write `path` (.safetensors) and its `.json` sidecar; returns the sidecar's path."""
        from safetensors.numpy import save_file

        path = Path(path)
        sidecar = sidecar_path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight, "bias": np.array([self.bias], dtype=np.float32)}, str(path))
        sidecar.write_text(
            json.dumps(
                {"format": FORMAT, "version": VERSION, "features": asdict(self.features), "stats": self.stats}, indent=1
            )
        )
        return sidecar

    @classmethod
    def load(cls, path: str | Path) -> "QualityClassifier":
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        path = Path(path)
        sidecar = sidecar_path(path)
        for p in (path, sidecar):
            if not p.is_file():
                raise DataError(
                    f"{p}: no such file (a quality classifier is a .safetensors file with a .json "
                    "sidecar, written by `kiln classifier train`)"
                )
        try:
            meta = json.loads(sidecar.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"{sidecar}: not valid JSON ({err})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise DataError(f"{sidecar}: not a {FORMAT} version {VERSION} sidecar")
        try:
            features = FeatureConfig(**meta["features"])
            features.validate()
        except (TypeError, KeyError, ConfigError) as err:
            raise DataError(f"{sidecar}: bad feature config ({err})") from None
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise DataError(f"{path}: not a readable safetensors file ({err})") from None
        weight, bias = tensors.get("weight"), tensors.get("bias")
        if weight is None or bias is None or weight.shape != (features.buckets,) or bias.shape != (1,):
            raise DataError(f"{path}: expected tensors weight [{features.buckets}] and bias [1]")
        return cls(weight, float(bias[0]), features, meta.get("stats"))


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ConfigError("model_path", f"{path}: a quality classifier file must end in .safetensors")
    return path.with_suffix(".json")


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve as the Mann-Whitney U statistic (tied scores count one half)."""
    labels = np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    sorted_scores = np.asarray(scores)[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # Average rank within each run of equal scores.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def train_quality_classifier(
    positive: Iterable[str],
    negative: Iterable[str],
    buckets: int = 2**18,
    epochs: int = 5,
    lr: float = 0.5,
    l2: float = 1e-6,
    batch_size: int = 32,
    heldout_fraction: float = 0.1,
    seed: int = 0,
    word_ngrams: int = 2,
    cjk_char_ngram: int = 3,
) -> QualityClassifier:
    """Fit P(positive | text) on reference texts (positive) vs raw texts (negative).

    Optimiser: mini-batch Adagrad on the logistic loss. Hashed n-gram features are extremely sparse
    and Zipf-distributed; Adagrad's per-coordinate step size lets a rare but telling n-gram move as
    far as a frequent one, which plain SGD with one learning rate does not, and it needs no
    schedule; lr 0.5 is the usual Adagrad starting point for logistic regression on L2-normalised
    rows (each row's dot product is bounded by the weights' norm) and converged fastest of 0.2/0.5
    on the Python docs vs junk test. L2 (`l2`, applied to the touched coordinates each step, so a step costs the batch's
    features, not all buckets) keeps weights of n-grams seen in only one or two documents small.
    Each class's loss is weighted by total/(2 * class count), so an unbalanced reference set does
    not just shift the bias: a score of 0.5 means "as likely reference as raw" under equal priors.
    `heldout_fraction` of the documents (seeded shuffle) are kept out of training; the model's
    `stats` report accuracy (at 0.5) and ROC AUC on them.
    """
    features = FeatureConfig(buckets, word_ngrams, cjk_char_ngram)
    features.validate()
    if epochs < 1:
        raise ConfigError("epochs", f"must be >= 1, got {epochs}")
    if lr <= 0 or l2 < 0 or batch_size < 1:
        raise ConfigError("lr", f"need lr > 0, l2 >= 0, batch_size >= 1; got {lr}, {l2}, {batch_size}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise ConfigError("heldout_fraction", f"must be in [0, 1), got {heldout_fraction}")
    vecs = [featurize(t, features) for t in positive]
    n_pos = len(vecs)
    vecs += [featurize(t, features) for t in negative]
    n_neg = len(vecs) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise DataError(
            f"a quality classifier needs positive and negative documents; got {n_pos} positive, {n_neg} negative"
        )
    labels = np.concatenate([np.ones(n_pos), np.zeros(n_neg)])
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(vecs))
    n_held = int(round(heldout_fraction * len(vecs)))
    held, train = order[:n_held], order[n_held:]

    class_weight = np.array([len(vecs) / (2 * n_neg), len(vecs) / (2 * n_pos)])
    weight = np.zeros(buckets, dtype=np.float64)
    bias = 0.0
    grad_sq = np.zeros(buckets, dtype=np.float64)
    bias_grad_sq = 0.0
    eps = 1e-8
    losses = []
    for _ in range(epochs):
        epoch_loss = 0.0
        for start in range(0, train.size, batch_size):
            rows = train[start : start + batch_size]
            batch = SparseBatch.stack([vecs[i] for i in rows])
            y = labels[rows]
            w_row = class_weight[y.astype(np.int64)]
            p = _sigmoid(batch.dot(weight) + bias)
            epoch_loss += float(-(w_row * (y * np.log(p + 1e-12) + (1 - y) * np.log(1 - p + 1e-12))).sum())
            err = w_row * (p - y) / rows.size  # dLoss/dlogit per row, batch mean
            touched, inverse = np.unique(batch.indices, return_inverse=True)
            g = np.bincount(inverse, weights=batch.values * err[batch.row_ids()], minlength=touched.size)
            g += l2 * weight[touched]
            grad_sq[touched] += g * g
            weight[touched] -= lr * g / (np.sqrt(grad_sq[touched]) + eps)
            gb = float(err.sum())
            bias_grad_sq += gb * gb
            bias -= lr * gb / (math.sqrt(bias_grad_sq) + eps)
        losses.append(epoch_loss / train.size)
        train = rng.permutation(train)  # a fresh order each epoch, from the one seeded generator

    model = QualityClassifier(weight.astype(np.float32), bias, features)
    stats = {
        "positive": n_pos,
        "negative": n_neg,
        "train": int(train.size),
        "heldout": int(n_held),
        "epochs": epochs,
        "lr": lr,
        "l2": l2,
        "batch_size": batch_size,
        "seed": seed,
        "train_loss": [round(x, 5) for x in losses],
    }
    if n_held:
        held_batch = SparseBatch.stack([vecs[i] for i in held])
        scores = _sigmoid(held_batch.dot(model.weight) + model.bias)
        y = labels[held].astype(bool)
        stats["heldout_accuracy"] = round(float(np.mean((scores >= 0.5) == y)), 4)
        stats["heldout_auc"] = round(roc_auc(y, scores), 4)
    model.stats = stats
    return model


def _read_texts(paths: str | Path | Iterable[str | Path], counts: dict, key: str) -> list[str]:
    texts = []
    for path, name in list_named_inputs(paths):
        for doc, rejection in read_documents(path, name=name):
            if rejection is not None:
                counts[f"{key}_rejected"] += 1
                continue
            texts.append(doc["text"])
    return texts


def train_from_files(
    positive_paths: str | Path | Iterable[str | Path],
    negative_paths: str | Path | Iterable[str | Path],
    out_path: str | Path,
    **kwargs,
) -> dict:
    """Train on documents read from files/folders/globs (bad records skipped and counted), save the
    model to `out_path` (.safetensors + .json sidecar) and return its training stats."""
    sidecar_path(out_path)  # fail on a bad output name before reading any data
    counts = {"positive_rejected": 0, "negative_rejected": 0}
    positive = _read_texts(positive_paths, counts, "positive")
    negative = _read_texts(negative_paths, counts, "negative")
    model = train_quality_classifier(positive, negative, **kwargs)
    model.stats.update(counts)
    model.save(out_path)
    return {**model.stats, "model": str(out_path)}


# ---- the `kiln classifier train` verb ------------------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "classifier", help="train the data quality classifier used by the quality_classifier step"
    )
    act = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = act.add_parser("train", help="reference documents (positive) vs raw documents (negative)")
    c.add_argument("--positive", nargs="+", required=True, help="files/folders/globs of reference documents")
    c.add_argument("--negative", nargs="+", required=True, help="files/folders/globs of raw documents")
    c.add_argument("--out", required=True, help="model file to write (.safetensors, with a .json sidecar)")


def run(args) -> int:
    stats = train_from_files(args.positive, args.negative, args.out)
    print(json.dumps(stats, indent=1))
    return 0
