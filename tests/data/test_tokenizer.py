import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.data.config import TokenizerConfig
from kiln.data.corpus import choose_split_ids, stable_unit
from kiln.data.tokenizer import (
    MAX_PIECE_CHARS,
    MAX_TRAIN_WORD_CHARS,
    SPECIAL_TOKENS,
    Tokenizer,
    text_pieces,
    train_tokenizer,
    train_tokenizer_from_corpus,
    training_pieces,
)
from kiln.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[2]

SYLLABLES = ["ka", "lo", "mi", "ter", "on", "sa", "ri", "ven", "du", "pel", "ax", "qu", "is", "th", "ee"]


def synthetic_texts(n, seed=0):
    """Word-like prose and a little code, enough for BPE to learn a few hundred merges."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    texts = []
    for i in range(n):
        prose = " ".join(rng.choice(words) for _ in range(120))
        code = f"def f{i}(x):\n    return x * {rng.randint(0, 999)}\n"
        texts.append(prose + ".\n\n" + code)
    return texts


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    stats = train_tokenizer(
        synthetic_texts(200), TokenizerConfig(vocab_size=600), out, heldout=synthetic_texts(10, seed=1)
    )
    return out, stats


def test_special_tokens_come_first_and_vocab_is_exact(trained):
    out, stats = trained
    tok = Tokenizer.load(out)
    assert [tok.token_id(s) for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.eot_id == tok.token_id("<|endoftext|>") == 0
    for name in ("<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|mask|>", "<|reserved_0|>"):
        assert name in SPECIAL_TOKENS
    assert tok.vocab_size == stats["vocab_size"] == 600
    assert tok.sha256 == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest() == stats["tokenizer_sha256"]
    assert stats["heldout_tokens"] > 0 and stats["bytes_per_token"] == pytest.approx(
        stats["heldout_bytes"] / stats["heldout_tokens"], abs=1e-4
    )
    assert stats["bytes_per_token"] > 1.5  # merges learned: far fewer tokens than bytes
    with pytest.raises(DataError, match="no token '<|nope|>'"):
        tok.token_id("<|nope|>")


@pytest.mark.parametrize(
    "text",
    [
        "日本語と中文的文本，混合 English.",
        "emoji 🎉 flags 🏳️‍🌈 family 👨‍👩‍👧 skin 👍🏽",
        "tabs\tand\r\nwindows\rlines   trailing   \n\n\n",
        "\x00 control \x7f chars and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 astral",
        "",
    ],
)
def test_round_trip_is_exact(trained, text):
    tok = Tokenizer.load(trained[0])
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_random_unicode(trained):
    tok = Tokenizer.load(trained[0])
    rng = random.Random(0)
    # Every code point except surrogates (which UTF-8 cannot encode).
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    texts = ["".join(chr(rng.choice(points)) for _ in range(rng.randint(1, 60))) for _ in range(200)]
    assert [tok.decode(ids) for ids in tok.encode_batch(texts)] == texts


def test_special_token_text_in_documents(trained):
    tok = Tokenizer.load(trained[0])
    text = "a <|endoftext|> b"
    assert tok.eot_id in tok.encode(text)
    literal = tok.encode(text, parse_special=False)
    assert tok.eot_id not in literal and tok.decode(literal) == text
    assert tok.encode_batch([text], parse_special=False) == [literal]
    assert tok.eot_id in tok.encode(text)  # the flag does not stick


def test_transformers_loads_it_and_agrees(trained):
    transformers = pytest.importorskip("transformers")
    path = trained[0] / "tokenizer.json"
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    tok = Tokenizer.load(path)
    text = "def f(x):\n    return x  # 你好 🎉"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text
    assert hf.convert_tokens_to_ids("<|assistant|>") == tok.token_id("<|assistant|>")


def test_training_is_deterministic_and_respects_max_train_bytes(tmp_path, trained):
    texts = synthetic_texts(200)
    again = train_tokenizer(texts, TokenizerConfig(vocab_size=600), tmp_path / "again", heldout=[])
    assert again["tokenizer_sha256"] == trained[1]["tokenizer_sha256"]
    limit = 20_000
    capped = train_tokenizer(
        texts, TokenizerConfig(vocab_size=600, max_train_bytes=limit), tmp_path / "cap", heldout=[]
    )
    assert 0 < capped["train_bytes"] <= limit
    assert capped["train_documents"] < len(texts)
    assert json.loads((tmp_path / "cap" / "stats.json").read_text())["train_bytes"] == capped["train_bytes"]


def test_heldout_documents_are_not_trained_on(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = synthetic_texts(300)
    cfg = TokenizerConfig(vocab_size=700, heldout_fraction=0.1)
    secret = "zqxwv"  # a word that occurs only in held-out documents, hundreds of times
    records, heldout_ids = [], []
    for i, text in enumerate(texts):
        doc_id = f"src/doc{i}"
        if stable_unit(doc_id) < cfg.heldout_fraction:
            heldout_ids.append(doc_id)
            text += (" " + secret) * 200
        records.append({"id": doc_id, "text": text, "source": "src" if i % 2 else "other", "meta": {}})
    assert heldout_ids
    (corpus / "docs-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    stats = train_tokenizer_from_corpus(corpus, cfg, tmp_path / "tok")
    assert stats["heldout_documents"] == len(heldout_ids)
    assert stats["train_documents"] == len(texts) - len(heldout_ids)
    assert set(stats["heldout_by_source"]) <= {"src", "other"}
    tok = Tokenizer.load(tmp_path / "tok")
    # Trained on, the word would have become one token (it is frequent enough to be merged).
    assert len(tok.encode(" " + secret)) > 1
    assert " " + secret not in tok.hf.get_vocab() and "Ġ" + secret not in tok.hf.get_vocab()


def test_bad_inputs(tmp_path):
    with pytest.raises(DataError, match="not found"):
        Tokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        Tokenizer.load(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="vocab_size"):
        train_tokenizer(["x"], TokenizerConfig(vocab_size=100), tmp_path / "t", heldout=[])
    with pytest.raises(DataError, match="no \\*.jsonl"):
        train_tokenizer_from_corpus(tmp_path / "missing", TokenizerConfig(), tmp_path / "t")


def test_a_lone_surrogate_is_named_not_a_unicode_error(tmp_path, trained):
    """A "\\ud800" escape decodes in Python but no tokenizer can encode it: in a corpus folder it is a
    DataError naming path:line before training starts; passed to encode, a DataError too."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    good = [json.dumps({"id": f"d{i}", "text": text, "source": "s"}) for i, text in enumerate(synthetic_texts(20))]
    bad = '{"id": "x", "text": "lone \\ud800 surrogate", "source": "s"}'
    (corpus / "docs-00000.jsonl").write_text("\n".join([*good[:5], bad, *good[5:]]) + "\n")
    with pytest.raises(DataError, match=r"docs-00000\.jsonl:6: holds a lone surrogate"):
        train_tokenizer_from_corpus(corpus, TokenizerConfig(vocab_size=512), tmp_path / "tok")
    with pytest.raises(DataError, match="text 1 of 2 to encode holds a lone surrogate"):
        Tokenizer.load(trained[0] / "tokenizer.json").encode_batch(["fine", "caf\udce9"])


PEAK_RSS_SCRIPT = """
import random, string, sys
from pathlib import Path
from kiln.data.config import TokenizerConfig
from kiln.data.tokenizer import Tokenizer, train_tokenizer
rng = random.Random(0)
words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
line = " ".join(rng.choices(words, k=int(float(sys.argv[2]) * 1e6) // 6))  # one line, no newline
out = Path(sys.argv[3])
if sys.argv[1] == "train":
    train_tokenizer([line], TokenizerConfig(vocab_size=1024), out, heldout=[])
else:
    ids = Tokenizer.load(out / "tokenizer.json").encode(line, parse_special=False)
    assert len(ids) > len(line) // 10
# VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over from the parent (pytest) across exec.
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) // 1024)
"""


def peak_rss_mb(*args) -> int:
    """Peak resident memory of a fresh Python process running PEAK_RSS_SCRIPT with args."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_SCRIPT, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="peak memory is read from /proc (Linux)")
def test_one_long_line_trains_and_encodes_in_bounded_memory(tmp_path):
    """A 4 MB line with spaces (the 50 MB one peaked at 8.9 GB): fed to the trainer and the encoder
    in pieces, training stays under 200 MB and encoding under 300 MB. Unsplit, the library holds
    per-character data for the whole line: about 400 MB to train on it and 800 MB to encode it."""
    assert peak_rss_mb("train", 4, tmp_path) < 200
    assert peak_rss_mb("encode", 4, tmp_path) < 300


def test_a_line_without_whitespace_is_trained_on_in_word_sized_slices(tmp_path):
    """A 1 MB run of non-whitespace is one pre-token; BPE rescans it at every merge (0.4 MB of random
    letters took minutes). The trainer sees it in MAX_TRAIN_WORD_CHARS slices, so no learned token
    is longer, where the whole run would grow tokens hundreds of characters long."""
    line = "abcdefghijklmnopqrstuvwxyz0123456789" * 30_000
    pieces = list(training_pieces(f"start {line} end"))
    assert "".join(pieces) == f"start {line} end"
    assert max(len(p) for p in pieces) == MAX_TRAIN_WORD_CHARS
    train_tokenizer(["abc " * 10_000 + line], TokenizerConfig(vocab_size=1024), tmp_path, heldout=[])
    tok = Tokenizer.load(tmp_path / "tokenizer.json")
    longest = max(len(tok.decode([i])) for i in range(len(SPECIAL_TOKENS), tok.vocab_size))
    assert 16 <= longest <= MAX_TRAIN_WORD_CHARS


def test_long_texts_encode_in_pieces_to_the_ids_of_the_whole(trained):
    """Pieces are cut where the pre-split cuts anyway, so a text longer than MAX_PIECE_CHARS (words,
    runs of spaces, newlines, punctuation, special-token text) gets the ids the library gives it whole."""
    tok = Tokenizer.load(trained[0] / "tokenizer.json")
    rng = random.Random(3)
    parts = ["word", " word", "  ", "\n", "\n\n", " \n", "\r\n", "\t", ".", ", ", "'s", "12345", "é", "<|endoftext|>"]
    text = "".join(rng.choice(parts) for _ in range(3 * MAX_PIECE_CHARS // 3))
    assert len(text_pieces(text)) > 2
    whole = tok.hf.encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == whole
    assert tok.encode_batch(["short", text, "also short"])[1] == whole


def test_path_reuses_an_existing_tokenizer(tmp_path, trained):
    """tokenizer.path (continual pretraining): the earlier tokenizer's exact file, measured on this
    corpus's held-out documents; the ids of a pack made with it match the earlier run's."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    records = [{"id": f"d{i}", "text": t, "source": "s", "meta": {}} for i, t in enumerate(synthetic_texts(60, seed=3))]
    (corpus / "docs-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    folder, first = trained
    cfg = TokenizerConfig(vocab_size=600, path=str(folder))
    cfg.validate()
    stats = train_tokenizer_from_corpus(corpus, cfg, tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert stats["tokenizer_sha256"] == first["tokenizer_sha256"] and stats["vocab_size"] == first["vocab_size"]
    heldout = [r["text"] for r in records if r["id"] in choose_split_ids(corpus, cfg.heldout_fraction)]
    assert stats["heldout_documents"] == len(heldout) > 0
    tok = Tokenizer.load(folder)
    assert stats["heldout_bytes"] == sum(len(t.encode("utf-8")) for t in heldout)
    assert stats["heldout_tokens"] == sum(len(tok.encode(t, parse_special=False)) for t in heldout)
    with pytest.raises(DataError, match="tokenizer.path: .*no such tokenizer.json"):
        train_tokenizer_from_corpus(corpus, TokenizerConfig(path=str(tmp_path / "none")), tmp_path / "t2")
    with pytest.raises(DataError, match="more than tokenizer.vocab_size=512"):
        train_tokenizer_from_corpus(corpus, TokenizerConfig(vocab_size=512, path=str(folder)), tmp_path / "t3")
    for key, value in (("min_frequency", 3), ("max_train_bytes", 100)):
        with pytest.raises(ConfigError, match=f"{key}: trains a tokenizer, but path"):
            TokenizerConfig(path=str(folder), **{key: value}).validate()
