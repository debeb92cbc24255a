import json
import random

import numpy as np
import pytest

from kiln.data.config import CorpusConfig, PackConfig, TokenizerConfig
from kiln.data.corpus import build_corpus, iter_documents, stable_unit
from kiln.data.loader import TokenLoader
from kiln.data.pack import pack, token_dtype
from kiln.data.tokenizer import Tokenizer, train_tokenizer, train_tokenizer_from_corpus
from kiln.errors import ConfigError, DataError


def make_corpus(folder, n=(120, 40)):
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(400)]
    words += ["日本", "🎉", "return", "def", "self"]
    records = []
    for source, count in zip(("prose", "code"), n):
        for i in range(count):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 200)))
            if i == 3:
                text += " literal <|endoftext|> inside a document"
            records.append({"id": f"{source}/{i}", "text": text, "source": source, "meta": {"i": i}})
    folder.mkdir(parents=True)
    half = len(records) // 2
    (folder / "docs-00000.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[:half]))
    (folder / "docs-00001.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records[half:]))
    return records


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    records = make_corpus(root / "corpus")
    train_tokenizer([r["text"] for r in records], TokenizerConfig(vocab_size=512), root / "tok", heldout=[])
    # small shards: several files per source; min_val_docs=0: the split is the hash rule alone
    cfg = PackConfig(val_fraction=0.1, shard_tokens=2000, min_val_docs=0)
    stats = pack(root / "corpus", root / "tok" / "tokenizer.json", cfg, root / "pack")
    return root, records, stats, cfg


def read_stream(folder, source):
    """All of one source's tokens across its shards, in shard order, plus the headers."""
    headers = [json.loads(p.read_text()) for p in sorted(folder.glob(f"{source}-*.json"))]
    tokens = [np.fromfile(p, dtype="<u2") for p in sorted(folder.glob(f"{source}-*.bin"))]
    return np.concatenate(tokens), headers, tokens


def test_headers_describe_their_shards(packed):
    root, records, stats, _ = packed
    tok = Tokenizer.load(root / "tok")
    for split in ("train", "val"):
        for path in sorted((root / "pack" / split).glob("*.json")):
            header = json.loads(path.read_text())
            assert header["dtype"] == "uint16" and header["vocab_size"] == tok.vocab_size == 512
            assert header["tokenizer_sha256"] == tok.sha256
            assert header["source"] == path.name.split("-")[0]
            assert path.with_suffix(".bin").stat().st_size == 2 * header["tokens"]
            tokens = np.fromfile(path.with_suffix(".bin"), dtype="<u2")
            assert int((tokens == tok.eot_id).sum()) == header["documents"]  # one eot per document
            assert tokens[-1] == tok.eot_id  # documents never cut across shards
    assert len(list((root / "pack" / "train").glob("prose-*.bin"))) > 1
    assert stats["train"]["documents"] + stats["val"]["documents"] == len(records)


def test_shards_hold_each_document_then_eot_in_corpus_order(packed):
    root, records, _, cfg = packed
    tok = Tokenizer.load(root / "tok")
    mixture = json.loads((root / "pack" / "mixture.json").read_text())
    for source in ("prose", "code"):
        for split in ("train", "val"):
            docs = [
                r
                for r in records
                if r["source"] == source and (stable_unit(r["id"]) < cfg.val_fraction) == (split == "val")
            ]
            stream, headers, _ = read_stream(root / "pack" / split, source)
            ends = np.flatnonzero(stream == tok.eot_id)
            starts = np.concatenate([[0], ends[:-1] + 1])
            texts = [tok.decode(stream[s:e].tolist()) for s, e in zip(starts, ends)]
            assert texts == [d["text"] for d in docs]
            assert sum(h["bytes"] for h in headers) == sum(len(d["text"].encode()) for d in docs)
    train_tokens = {s: read_stream(root / "pack" / "train", s)[0].size for s in ("prose", "code")}
    total = sum(train_tokens.values())
    assert mixture["weights"] == pytest.approx({s: n / total for s, n in train_tokens.items()})
    assert mixture["tokenizer_sha256"] == tok.sha256 and mixture["vocab_size"] == 512


def test_every_source_with_two_documents_gets_validation_data(tmp_path):
    records = make_corpus(tmp_path / "corpus", n=(30, 2))
    train_tokenizer([r["text"] for r in records], TokenizerConfig(vocab_size=512), tmp_path / "tok", heldout=[])
    # A fraction so small that the hash alone selects nothing.
    cfg = PackConfig(val_fraction=1e-6, min_val_docs=0)
    stats = pack(tmp_path / "corpus", tmp_path / "tok", cfg, tmp_path / "pack")
    assert stats["sources"]["prose"]["val"]["documents"] == 1
    assert stats["sources"]["code"]["val"]["documents"] == 1
    assert stats["sources"]["code"]["train"]["documents"] == 1


def test_explicit_mixture_is_normalised_and_unknown_sources_are_config_errors(packed, tmp_path):
    root = packed[0]
    stats = pack(root / "corpus", root / "tok", PackConfig(mixture={"prose": 3, "code": 1}), tmp_path / "p1")
    assert stats["weights"] == {"code": 0.25, "prose": 0.75}
    stats = pack(root / "corpus", root / "tok", PackConfig(mixture={"code": 2}), tmp_path / "p2")
    assert stats["weights"] == {"code": 1.0, "prose": 0.0}
    with pytest.raises(ConfigError, match="mixture.nope"):
        pack(root / "corpus", root / "tok", PackConfig(mixture={"prose": 1, "nope": 1}), tmp_path / "p3")


def test_repack_is_deterministic_and_leaves_no_stale_shards(packed, tmp_path):
    root, _, _, cfg = packed
    pack(root / "corpus", root / "tok", cfg, tmp_path / "p")
    again = {p.relative_to(tmp_path / "p"): p.read_bytes() for p in sorted((tmp_path / "p").rglob("*.bin"))}
    original = {p.relative_to(root / "pack"): p.read_bytes() for p in sorted((root / "pack").rglob("*.bin"))}
    assert again == original
    pack(root / "corpus", root / "tok", PackConfig(val_fraction=cfg.val_fraction, min_val_docs=0), tmp_path / "p")
    assert sorted(p.name for p in (tmp_path / "p" / "train").glob("*.bin")) == ["code-00000.bin", "prose-00000.bin"]


def test_token_dtype_follows_vocab_size():
    assert token_dtype(512) == np.dtype("<u2")
    assert token_dtype(65536) == np.dtype("<u2")  # ids 0..65535 fit
    assert token_dtype(65537) == np.dtype("<u4")


def test_bad_inputs(tmp_path, packed):
    root = packed[0]
    with pytest.raises(DataError, match="no \\*.jsonl"):
        pack(tmp_path / "missing", root / "tok", PackConfig(), tmp_path / "out")
    with pytest.raises(DataError, match="tokenizer file not found"):
        pack(root / "corpus", tmp_path / "no-tok", PackConfig(), tmp_path / "out")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "docs-00000.jsonl").write_text('{"id": "a", "text": "x", "source": "s"}\n{"id": 1}\n')
    with pytest.raises(DataError, match="docs-00000.jsonl:2: field 'id'"):
        pack(bad, root / "tok", PackConfig(), tmp_path / "out")


def test_real_sources_end_to_end(tmp_path):
    """The built-in sources through corpus, tokenizer, pack and loader, kept tiny for speed."""
    corpus_stats = build_corpus(CorpusConfig(max_bytes_per_source=40_000), tmp_path / "corpus")
    for name in ("python_stdlib", "python_docs"):
        assert 0 < corpus_stats["sources"][name]["bytes"] <= 40_000
    tok_stats = train_tokenizer_from_corpus(tmp_path / "corpus", TokenizerConfig(vocab_size=512), tmp_path / "tok")
    assert tok_stats["bytes_per_token"] > 1.5
    stats = pack(tmp_path / "corpus", tmp_path / "tok", PackConfig(val_fraction=0.05), tmp_path / "pack")
    assert stats["train"]["documents"] + stats["val"]["documents"] == sum(
        1 for _ in iter_documents(tmp_path / "corpus")
    )
    loader = TokenLoader(tmp_path / "pack", seq_len=64, batch_size=4)
    x, y = next(loader)
    assert x.shape == y.shape == (4, 64) and int(x.max()) < loader.vocab_size
    assert 1.5 < loader.bytes_per_token < 8
    val = TokenLoader(tmp_path / "pack", split="val", seq_len=64, batch_size=2)
    assert len(list(val.iter_batches(3))) >= 1


@pytest.mark.parametrize("sources", [["web"], ["web", "code", "books"]])
def test_a_corpus_too_small_to_split_is_refused_with_the_minimum(tmp_path, sources):
    """One document (or one per source) leaves nothing to hold out: the tokenizer and the packer
    refuse it naming the corpus and the minimum, instead of an empty validation split."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [json.dumps({"id": f"{s}-0", "text": f"the only {s} document, " * 20, "source": s}) for s in sources]
    (corpus / "docs-00000.jsonl").write_text("\n".join(lines) + "\n")
    minimum = rf"{corpus}: {len(sources)} documents? in {len(sources)} sources?, too few to split: a corpus needs at least 2 documents"
    with pytest.raises(DataError, match=minimum):
        train_tokenizer_from_corpus(corpus, TokenizerConfig(vocab_size=512), tmp_path / "tok")
    train_tokenizer(["some text to train on " * 50], TokenizerConfig(vocab_size=512), tmp_path / "tok", heldout=[])
    with pytest.raises(DataError, match=minimum):
        pack(corpus, tmp_path / "tok" / "tokenizer.json", PackConfig(), tmp_path / "packed")
    # A second document of one source is enough.
    extra = json.dumps({"id": "web-1", "text": "a second web document, " * 20, "source": "web"})
    (corpus / "docs-00000.jsonl").write_text("\n".join([*lines, extra]) + "\n")
    stats = pack(corpus, tmp_path / "tok" / "tokenizer.json", PackConfig(min_val_docs=0), tmp_path / "packed")
    assert stats["val"]["documents"] == 1


def test_a_validation_split_below_the_minimum_is_widened_with_a_warning(tmp_path, capsys):
    """105 documents at val_fraction 0.01: the hash rule holds out a couple; pack.min_val_docs widens
    the split to the next documents in hash order (the ones a larger fraction would take) and says so."""
    records = make_corpus(tmp_path / "corpus", n=(105, 0))
    train_tokenizer([r["text"] for r in records], TokenizerConfig(vocab_size=512), tmp_path / "tok", heldout=[])
    by_hash = sorted(records, key=lambda r: stable_unit(r["id"]))
    by_rule = [r for r in records if stable_unit(r["id"]) < 0.01] or by_hash[:1]
    stats = pack(tmp_path / "corpus", tmp_path / "tok", PackConfig(min_val_docs=20), tmp_path / "pack")
    assert stats["val"]["documents"] == 20 and stats["train"]["documents"] == 85
    val_texts = {r["text"] for r in by_hash[:20]}
    tok = Tokenizer.load(tmp_path / "tok" / "tokenizer.json")
    stream, _, _ = read_stream(tmp_path / "pack" / "val", "prose")
    ends = np.flatnonzero(stream == tok.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert {tok.decode(stream[s:e].tolist()) for s, e in zip(starts, ends)} == val_texts
    out = capsys.readouterr().out
    assert f"warning: pack.val_fraction=0.01 holds out {len(by_rule)} document" in out
    assert "validating on 20 (pack.min_val_docs=20" in out
    # Off, or already met: the hash rule alone, no warning.
    stats = pack(tmp_path / "corpus", tmp_path / "tok", PackConfig(min_val_docs=0), tmp_path / "p0")
    assert stats["val"]["documents"] == len(by_rule) and "warning" not in capsys.readouterr().out
    # A tiny corpus keeps at least half of its documents for training.
    small = make_corpus(tmp_path / "small", n=(6, 0))
    assert pack(tmp_path / "small", tmp_path / "tok", PackConfig(), tmp_path / "p1")["val"]["documents"] == 3
    assert len(small) == 6
