"""The quality classifier: features, training on real text, save/load, and the quality_classifier step."""

import json
import random
import re

import numpy as np
import pytest

from kiln.data.classifier import (
    FeatureConfig,
    QualityClassifier,
    feature_strings,
    featurize,
    roc_auc,
    train_from_files,
    train_quality_classifier,
)
from kiln.data.executor import run_pipeline
from kiln.data.steps.base import build_step
from kiln.data.steps.classifier import QualityClassifierFilter
from kiln.errors import ConfigError, DataError

BOILERPLATE = [
    "Home | About | Contact",
    "Click here to subscribe to our newsletter!",
    "Copyright 2024 All rights reserved.",
    "Login  Register  Cart (0)",
    "Share on Facebook Twitter Pinterest",
    "Accept cookies to continue",
]


def reference_paragraphs() -> list[str]:
    """Prose paragraphs of the Python reference manual (pydoc_data ships with CPython): real text
    nobody here wrote. Indented blocks are code examples and grammar, not prose; they are left out."""
    import pydoc_data.topics

    return [
        p.strip()
        for page in pydoc_data.topics.topics.values()
        for p in re.split(r"\n\s*\n", page)
        if len(p.split()) >= 20 and not p.startswith(" ")
    ]


def junk(n: int, vocab: list[str], seed: int = 0) -> list[str]:
    """Raw-web-like junk in three kinds: the reference's own words shuffled (same unigrams, broken
    word order), boilerplate navigation lines, and one token repeated."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(" ".join(rng.sample(vocab, 60)))
        elif i % 3 == 1:
            out.append("\n".join(rng.choice(BOILERPLATE) for _ in range(8)))
        else:
            out.append(" ".join([rng.choice(vocab)] * rng.randint(20, 60)))
    return out


@pytest.fixture(scope="module")
def corpus():
    pos = reference_paragraphs()
    vocab = [w for p in pos for w in p.split()]
    return pos, junk(len(pos), vocab)


@pytest.fixture(scope="module")
def model(corpus):
    pos, neg = corpus
    return train_quality_classifier(pos, neg, seed=0)


@pytest.fixture(scope="module")
def model_file(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("clf") / "quality.safetensors"
    model.save(path)
    return path


def test_features_are_deterministic_normalised_and_signed():
    cfg = FeatureConfig()
    idx, vals = featurize("The cat sat on the mat. The cat sat.", cfg)
    idx2, vals2 = featurize("The cat sat on the mat. The cat sat.", cfg)
    assert np.array_equal(idx, idx2) and np.array_equal(vals, vals2)
    assert np.all(np.diff(idx) > 0) and idx.max() < cfg.buckets
    assert np.sum(vals.astype(np.float64) ** 2) == pytest.approx(1.0, abs=1e-6)
    assert (vals < 0).any() and (vals > 0).any()  # the hash's sign bit is used
    # Unigrams + bigrams, lowercased: 9 words -> 9 + 8 feature strings.
    assert len(feature_strings("The cat sat on the mat. The cat sat.", cfg)) == 17
    empty_idx, empty_vals = featurize("... --- !!!", cfg)
    assert empty_idx.size == 0 and empty_vals.size == 0


def test_cjk_text_gets_character_trigrams():
    cfg = FeatureConfig()
    feats = feature_strings("我们今天学习机器学习", cfg)
    # 10 character-words: 10 unigrams, 9 bigrams, 8 character 3-grams.
    assert len(feats) == 27
    assert "c\x1f机器学" in feats
    assert all(not f.startswith("c\x1f") for f in feature_strings("machine learning today is fun", cfg))


def test_roc_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    labels = rng.random(200) < 0.4
    scores = np.round(rng.random(200) + labels * 0.3, 1)  # rounding plants ties
    pos, neg = scores[labels], scores[~labels]
    pairwise = np.mean((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :]))
    assert roc_auc(labels, scores) == pytest.approx(pairwise, abs=1e-12)


def test_training_separates_reference_from_junk(model, corpus):
    pos, neg = corpus
    stats = model.stats
    assert stats["positive"] == len(pos) and stats["negative"] == len(neg)
    assert stats["heldout"] == round(0.1 * (len(pos) + len(neg)))
    assert stats["heldout_accuracy"] > 0.9
    assert stats["heldout_auc"] > 0.95
    assert stats["train_loss"][-1] < stats["train_loss"][0]
    # New junk of each kind, never seen in training, scores below fresh reference-like text.
    fresh_junk = junk(30, [w for p in pos for w in p.split()], seed=123)
    assert np.mean(model.score(fresh_junk) < 0.5) > 0.9


def test_training_is_seeded(corpus):
    pos, neg = corpus
    a = train_quality_classifier(pos[:200], neg[:200], seed=3, epochs=2)
    b = train_quality_classifier(pos[:200], neg[:200], seed=3, epochs=2)
    c = train_quality_classifier(pos[:200], neg[:200], seed=4, epochs=2)
    assert np.array_equal(a.weight, b.weight) and a.stats == b.stats
    assert not np.array_equal(a.weight, c.weight)


def test_save_load_round_trip(model, model_file, corpus):
    pos, neg = corpus
    sidecar = model_file.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    assert meta["features"] == {"buckets": 2**18, "word_ngrams": 2, "cjk_char_ngram": 3}
    loaded = QualityClassifier.load(model_file)
    texts = pos[:50] + neg[:50]
    assert np.array_equal(loaded.score(texts), model.score(texts))
    assert loaded.stats["heldout_accuracy"] == model.stats["heldout_accuracy"]


def test_load_errors_name_the_file(tmp_path, model_file):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(DataError, match=re.escape(str(missing))):
        QualityClassifier.load(missing)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    bad.with_suffix(".json").write_text(model_file.with_suffix(".json").read_text())
    with pytest.raises(DataError, match=re.escape(str(bad))):
        QualityClassifier.load(bad)
    with pytest.raises(ConfigError, match="must end in .safetensors"):
        QualityClassifier.load(tmp_path / "model.bin")


def test_train_from_files_skips_rejections(tmp_path, corpus):
    pos, neg = corpus
    (tmp_path / "ref.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in pos[:100]) + "{broken json\n")
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "raw.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in neg[:100]) + json.dumps({"text": ""}) + "\n"
    )
    out = tmp_path / "m" / "clf.safetensors"
    stats = train_from_files(tmp_path / "ref.jsonl", [tmp_path / "raw"], out, epochs=2)
    assert stats["positive"] == 100 and stats["negative"] == 100
    assert stats["positive_rejected"] == 1 and stats["negative_rejected"] == 1
    assert out.is_file() and out.with_suffix(".json").is_file()
    assert QualityClassifier.load(out).stats["positive"] == 100


def _write_inputs(tmp_path, texts: list[str], shards: int = 2):
    paths = []
    for s in range(shards):
        path = tmp_path / f"in-{s}.jsonl"
        path.write_text(
            "".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts) if i % shards == s)
        )
        paths.append(path)
    return paths


def _kept_and_dropped(out):
    kept = [json.loads(line) for p in sorted((out / "docs").glob("*.jsonl")) for line in p.open()]
    dropped = [json.loads(line) for p in sorted((out / "rejected").glob("*.jsonl")) for line in p.open()]
    return kept, [r for r in dropped if r["step"] == "quality_classifier"]


def test_step_keeps_top_fraction_across_tasks(tmp_path, model_file, corpus):
    pos, neg = corpus
    texts = pos[-20:] + neg[-21:]
    step = build_step("quality_classifier", {"model_path": str(model_file), "keep_top_fraction": 0.5}, "data")
    out = tmp_path / "out"
    stats = run_pipeline(_write_inputs(tmp_path, texts), [step], out, tasks=2, log=lambda *_: None)
    kept, dropped = _kept_and_dropped(out)
    assert abs(len(kept) - len(texts) / 2) <= 1 and len(kept) + len(dropped) == len(texts)
    assert all(r["reason"] == "low_quality_score" for r in dropped)
    kept_scores = [d["meta"]["quality_score"] for d in kept]
    dropped_scores = [r["doc"]["meta"]["quality_score"] for r in dropped]
    assert min(kept_scores) >= max(dropped_scores)
    # The scores in meta are the model's own.
    model = QualityClassifier.load(model_file)
    by_id = {f"d{i}": s for i, s in enumerate(model.score(texts))}
    for d in kept:
        assert d["meta"]["quality_score"] == pytest.approx(float(by_id[d["id"]]), abs=1e-6)
    step_stats = next(s for s in stats["steps"] if s["name"] == "quality_classifier")
    assert step_stats["counters"]["kept"] == len(kept)


@pytest.mark.parametrize("side", ["at", "above"])
def test_step_threshold_both_sides(tmp_path, model_file, corpus, side):
    pos, neg = corpus
    texts = pos[:5] + neg[:5]
    scores = QualityClassifier.load(model_file).score(texts)
    pivot = float(scores[0])  # a reference paragraph's exact score
    threshold = pivot if side == "at" else float(np.nextafter(np.float32(pivot), np.float32(1)))
    step = QualityClassifierFilter(model_path=str(model_file), threshold=threshold)
    step.validate()
    out = tmp_path / "out"
    run_pipeline(_write_inputs(tmp_path, texts, shards=1), [step], out, log=lambda *_: None)
    kept, dropped = _kept_and_dropped(out)
    kept_ids = {d["id"] for d in kept}
    assert kept_ids == {f"d{i}" for i, s in enumerate(scores) if s >= threshold}
    assert ("d0" in kept_ids) == (side == "at")
    assert {r["doc"]["id"] for r in dropped} == {f"d{i}" for i in range(10)} - kept_ids


def test_step_config_errors(tmp_path, model_file):
    with pytest.raises(ConfigError, match="model_path: required"):
        build_step("quality_classifier", {}, "data")
    missing = tmp_path / "gone.safetensors"
    with pytest.raises(ConfigError, match=re.escape(f"data.model_path: {missing}: no such file")):
        build_step("quality_classifier", {"model_path": str(missing)}, "data")
    with pytest.raises(ConfigError, match="keep_top_fraction"):
        build_step("quality_classifier", {"model_path": str(model_file), "keep_top_fraction": 1.5}, "data")
    with pytest.raises(ConfigError, match="threshold"):
        build_step("quality_classifier", {"model_path": str(model_file), "threshold": -0.1}, "data")
