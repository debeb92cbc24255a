"""Token shards packed into and trained from S3 (a moto server on 127.0.0.1): a local copy, each
shard checked against its header's sha256 at every load."""

import json
import random

import numpy as np
import pytest

from kiln import storage
from kiln.data.config import PackConfig, TokenizerConfig
from kiln.data.loader import TokenLoader
from kiln.data.pack import pack
from kiln.data.tokenizer import train_tokenizer
from kiln.errors import DataError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("s3pack")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6))) for _ in range(200)]
    records = [
        {"id": f"{s}/{i}", "text": " ".join(rng.choice(words) for _ in range(60)), "source": s, "meta": {}}
        for s in ("prose", "code")
        for i in range(30)
    ]
    (root / "corpus").mkdir()
    (root / "corpus" / "docs-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    train_tokenizer([r["text"] for r in records], TokenizerConfig(vocab_size=512), root / "tok", heldout=[])
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


CFG = PackConfig(val_fraction=0.1, shard_tokens=1500)


def _batches(pack_dir, n=6):
    loader = TokenLoader(pack_dir, seq_len=16, batch_size=4, seed=3)
    return [tuple(t.numpy() for t in next(loader)) for _ in range(n)]


def _pack_both(corpus, bucket, tmp_path):
    tok = corpus / "tok" / "tokenizer.json"
    local = pack(corpus / "corpus", tok, CFG, tmp_path / "pack")
    remote = pack(corpus / "corpus", tok, CFG, f"{bucket}/pack")
    return local, remote


def test_s3_pack_trains_like_the_local_one(corpus, s3_bucket, cache, tmp_path):
    local, remote = _pack_both(corpus, s3_bucket, tmp_path)
    assert {k: v for k, v in remote.items() if "second" not in k} == {
        k: v for k, v in local.items() if "second" not in k
    }
    assert len(storage.glob(f"{s3_bucket}/pack/train/*.bin")) > 1
    for (x, y), (lx, ly) in zip(_batches(f"{s3_bucket}/pack"), _batches(tmp_path / "pack")):
        assert np.array_equal(x, lx) and np.array_equal(y, ly)


def test_damaged_cached_shard_is_fetched_again(corpus, s3_bucket, cache, tmp_path):
    _pack_both(corpus, s3_bucket, tmp_path)
    expected = _batches(tmp_path / "pack")
    _batches(f"{s3_bucket}/pack")
    cached = sorted(cache.rglob("train/*.bin"))
    assert cached
    for path in cached:  # same size, different tokens: only the checksum tells
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))
    for (x, y), (lx, ly) in zip(_batches(f"{s3_bucket}/pack"), expected):
        assert np.array_equal(x, lx) and np.array_equal(y, ly)


def test_damaged_remote_shard_and_unpublished_pack_are_refused(corpus, s3_bucket, cache, tmp_path):
    _pack_both(corpus, s3_bucket, tmp_path)
    shard = storage.glob(f"{s3_bucket}/pack/train/*.bin")[0]
    storage.write_bytes(shard, b"\0\0" + storage.read_bytes(shard)[2:])
    with pytest.raises(DataError, match="sha256 does not match its header"):
        TokenLoader(f"{s3_bucket}/pack", seq_len=16, batch_size=4)
    storage.remove(f"{s3_bucket}/pack/stats.json")
    with pytest.raises(DataError, match="not a published pack"):
        TokenLoader(f"{s3_bucket}/pack", seq_len=16, batch_size=4)
