"""`quality_classifier`: score every document with a Kiln-trained quality classifier and keep the best.

The score (kiln.data.classifier: P(reference-like | text)) goes to `meta["quality_score"]` of every
document the step sees, kept or dropped. Two ways to decide:

- `threshold` (default 0.5): drop documents scoring below it;
- `keep_top_fraction` > 0: keep that fraction of all documents, highest scores first, across every
  task; `threshold` is then not used. This needs the whole dataset's scores, so the step is a
  Deduplicator: each task `index`es (scores its part), one `resolve` picks the cut, and each task
  then drops by it. With a plain threshold the same path costs one extra read of the parts and
  keeps one code path and one record of the scores.

Exactly round(fraction * documents) are kept; ties at the cut go to the earlier document in task
order, so the result is the same on every run. Dropped documents get the reason "low_quality_score".
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from kiln.data.classifier import QualityClassifier
from kiln.data.steps.base import Deduplicator, register
from kiln.errors import ConfigError

SCORE_BATCH_DOCS = 1024


def _task_file(workdir: Path, task: int, what: str) -> Path:
    return workdir / f"quality-{task:05d}-{what}"


def _save_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, ensure_ascii=False))
    os.replace(tmp, path)


def _save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


@register
@dataclass
class QualityClassifierFilter(Deduplicator):
    """Drops documents a trained quality classifier scores low (module doc)."""

    name = "quality_classifier"
    model_path: str = ""
    # 0.5: the classifier is trained with balanced class weights, so 0.5 is where a document is as
    # likely reference-like as raw-like.
    threshold: float = 0.5
    keep_top_fraction: float = 0.0

    def validate(self) -> None:
        if not self.model_path:
            raise ConfigError("model_path", "required: the .safetensors file written by `kiln classifier train`")
        path = Path(self.model_path)
        if path.suffix != ".safetensors":
            raise ConfigError("model_path", f"{path}: must be a .safetensors file (with a .json sidecar beside it)")
        for p in (path, path.with_suffix(".json")):
            if not p.is_file():
                raise ConfigError("model_path", f"{p}: no such file")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError("threshold", f"must be a probability in [0, 1], got {self.threshold}")
        if not 0.0 <= self.keep_top_fraction <= 1.0:
            raise ConfigError("keep_top_fraction", f"must be a fraction in [0, 1], got {self.keep_top_fraction}")

    def setup(self) -> None:
        # Loaded per worker, never pickled with the step: the weights are 1 MB per 2**18 buckets.
        if getattr(self, "_model", None) is None:
            self._model = QualityClassifier.load(self.model_path)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_model"] = None
        return state

    def index(self, docs: Iterable[dict], workdir: Path, task: int) -> None:
        self.setup()
        workdir.mkdir(parents=True, exist_ok=True)
        ids: list[str] = []
        scores: list[np.ndarray] = []
        batch: list[dict] = []

        def flush() -> None:
            scores.append(self._model.score([d["text"] for d in batch], [d["meta"].get("lang") for d in batch]))
            ids.extend(d["id"] for d in batch)
            batch.clear()

        for doc in docs:
            # The executor asks only documents of `only_sources` for a reason; index the same ones.
            if self.only_sources and doc["source"] not in self.only_sources:
                continue
            batch.append(doc)
            if len(batch) == SCORE_BATCH_DOCS:
                flush()
        if batch:
            flush()
        _save_npy(
            _task_file(workdir, task, "scores.npy"), np.concatenate(scores) if scores else np.empty(0, np.float32)
        )
        _save_json(_task_file(workdir, task, "ids.json"), ids)

    def resolve(self, workdir: Path, n_tasks: int) -> dict:
        per_task = [np.load(_task_file(workdir, t, "scores.npy")) for t in range(n_tasks)]
        scores = np.concatenate(per_task) if per_task else np.empty(0, np.float32)
        if self.keep_top_fraction > 0:
            n_keep = int(round(self.keep_top_fraction * scores.size))
            # Stable sort of -score: among equal scores the earlier document (task order) ranks first.
            ranked = np.argsort(-scores, kind="stable")
            keep = np.zeros(scores.size, dtype=bool)
            keep[ranked[:n_keep]] = True
            cutoff = float(scores[ranked[n_keep - 1]]) if n_keep else float("inf")
        else:
            keep = scores >= self.threshold
            cutoff = self.threshold
        start = 0
        for t, part in enumerate(per_task):
            _save_npy(_task_file(workdir, t, "keep.npy"), keep[start : start + part.size])
            start += part.size
        out = {
            "documents": int(scores.size),
            "kept": int(keep.sum()),
            "mean_score": round(float(scores.mean()), 4) if scores.size else 0.0,
        }
        if np.isfinite(cutoff):
            out["score_cutoff"] = round(cutoff, 6)
        return out

    def load(self, workdir: Path, task: int) -> None:
        ids = json.loads(_task_file(workdir, task, "ids.json").read_text(encoding="utf-8"))
        scores = np.load(_task_file(workdir, task, "scores.npy"))
        keep = np.load(_task_file(workdir, task, "keep.npy"))
        seen: Counter = Counter()
        self._decision: dict[tuple[str, int], tuple[float, bool]] = {}
        for doc_id, score, kept in zip(ids, scores.tolist(), keep.tolist()):
            self._decision[(doc_id, seen[doc_id])] = (score, kept)
            seen[doc_id] += 1
        self._seen: Counter = Counter()

    def reason(self, doc: dict) -> str | None:
        # Keyed by (id, occurrence) so two documents that share an id keep their own scores.
        key = (doc["id"], self._seen[doc["id"]])
        self._seen[doc["id"]] += 1
        score, kept = self._decision[key]
        doc["meta"]["quality_score"] = round(score, 6)
        return None if kept else "low_quality_score"
