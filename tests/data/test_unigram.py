"""tokenizer.model = "unigram": SentencePiece-style pieces with byte fallback. Exact round trips of
Chinese, emoji and code; the special tokens at BPE's ids; export that transformers loads with the
same ids and decoding; the keys that do not apply to a model refused by name."""

import json

import numpy as np
import pytest
from kiln_testing.text import stdlib_texts
from kiln_testing.tokenizer import train_tiny_tokenizer

from kiln.data.config import TokenizerConfig
from kiln.data.span import sentinel_ids
from kiln.data.tokenizer import SENTINEL, SPECIAL_TOKENS, text_pieces, train_tokenizer
from kiln.data.unigram import BYTE_TOKENS, SPACE, UNK
from kiln.errors import ConfigError

# Characters the training text has none of (stdlib source is ASCII-heavy): they exist only as bytes.
HARD = [
    "中文分词测试：你好，世界！",
    "emoji 🎉👍🏽 and a family 👨‍👩‍👧 flag 🇫🇷",
    "def f(x):\n\tif x  >  1:\n        return   x\r\n\n\n    # trailing   \n",
    "  leading spaces, trailing spaces  ",
    "\x00\x7f\ufeffzero-width\u200bjoiner",
    "literal <|endoftext|> and <0x41> and <unk> stay text",
]
SENTINELS = 3


@pytest.fixture(scope="module")
def unigram(tmp_path_factory):
    return train_tiny_tokenizer(
        tmp_path_factory.mktemp("unigram"),
        texts=stdlib_texts()[:12],
        vocab_size=600,
        model="unigram",
        sentinels=SENTINELS,
    )


@pytest.mark.parametrize("text", HARD)
def test_decode_of_encode_is_the_text(unigram, text):
    for parse_special in (False, True):
        ids = unigram.encode(text, parse_special=parse_special)
        if parse_special and "<|endoftext|>" in text:
            assert unigram.eot_id in ids  # parsed as the control token, and decoded back to its text
        assert unigram.decode(ids) == text
    ids = unigram.encode(text, parse_special=False)
    assert unigram.hf.token_to_id(UNK) not in ids  # byte fallback, never <unk>
    assert not set(ids) & set(range(len(SPECIAL_TOKENS) + SENTINELS))  # raw text injects no control token


def test_long_texts_encoded_in_pieces_give_the_ids_of_the_whole(unigram):
    text = "".join(HARD[:4]) * 3 + "x=1   \ny=2   \n" * 10  # cut after a newline that follows spaces
    pieces = text_pieces(text, max_chars=40)
    assert len(pieces) > 5 and "".join(pieces) == text
    split = unigram.hf.pre_tokenizer.pre_tokenize_str
    assert [w for piece in pieces for w, _ in split(piece)] == [w for w, _ in split(text)]
    assert [i for piece in pieces for i in unigram.encode(piece)] == unigram.encode(text)


def test_unseen_characters_become_their_utf8_bytes(unigram):
    ids = unigram.encode("中🎉", parse_special=False)
    assert [unigram.hf.id_to_token(i) for i in ids] == [f"<0x{b:02X}>" for b in "中🎉".encode("utf-8")]


def test_special_tokens_and_sentinels_sit_at_the_bpe_ids(unigram, tmp_path):
    bpe = train_tiny_tokenizer(tmp_path, texts=stdlib_texts()[:4], vocab_size=600, sentinels=SENTINELS)
    reserved = SPECIAL_TOKENS + [SENTINEL.format(k) for k in range(SENTINELS)]
    assert [unigram.token_id(t) for t in reserved] == [bpe.token_id(t) for t in reserved] == list(range(len(reserved)))
    assert unigram.hf.token_to_id(UNK) == len(reserved)
    assert [unigram.hf.token_to_id(b) for b in BYTE_TOKENS] == list(range(len(reserved) + 1, len(reserved) + 257))
    assert unigram.vocab_size == 600
    model = json.loads(unigram.hf.to_str())["model"]
    assert model["type"] == "Unigram" and model["byte_fallback"] is True
    # Pieces carry their space as SentencePiece's "▁", and code indentation is learned whole.
    assert SPACE + "return" in unigram.hf.get_vocab()
    assert sentinel_ids(unigram, SENTINELS).tolist() == [16, 17, 18]  # what T5 span corruption uses


def test_the_space_stand_in_and_nfkc_are_the_documented_changes(unigram, tmp_path):
    # U+2581 is the stand-in for a space, so a literal one comes back as a space (as in SentencePiece).
    assert unigram.decode(unigram.encode(f"a{SPACE}b", parse_special=False)) == "a b"
    nfkc = train_tiny_tokenizer(
        tmp_path, texts=stdlib_texts()[:4], vocab_size=600, model="unigram", normalization="nfkc"
    )
    text = "ｆｕｌｌ-width ﬁ ① x²"
    assert nfkc.decode(nfkc.encode(text, parse_special=False)) == "full-width fi 1 x2"
    assert unigram.decode(unigram.encode(text, parse_special=False)) == text  # "none" keeps it


def test_keys_of_the_other_model_are_refused_by_name(tmp_path):
    for bad, key in (
        (dict(model="wordpiece"), "model"),
        (dict(normalization="nfkc"), "normalization"),  # a BPE key it does not use
        (dict(model="unigram", normalization="nfd"), "normalization"),
        (dict(model="unigram", min_frequency=5), "min_frequency"),
    ):
        with pytest.raises(ConfigError, match=f"^{key}: "):
            TokenizerConfig(**bad).validate()
    # More distinct characters than pieces: named, with the count (the trainer keeps every character).
    texts = ["".join(chr(0x4E00 + k) for k in range(400))] * 3
    with pytest.raises(ConfigError, match=r"^vocab_size: 600 is too small .* 4\d\d distinct characters"):
        train_tokenizer(texts, TokenizerConfig(vocab_size=600, model="unigram"), tmp_path, heldout=[])


def test_export_loads_in_transformers_with_the_same_ids_and_decoding(unigram, tmp_path):
    transformers = pytest.importorskip("transformers")
    from kiln.hf import export_hf
    from kiln.model import ModelConfig, build_model

    cfg = ModelConfig(vocab_size=unigram.vocab_size, dim=32, n_layers=1, n_heads=2, max_seq_len=64)
    export_hf(cfg, build_model(cfg).state_dict(), unigram.path, tmp_path / "hf")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in HARD:
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ids == unigram.encode(text)
        assert hf.decode(ids) == unigram.decode(ids) == text
    assert hf.eos_token_id == unigram.eot_id and hf.mask_token_id == unigram.token_id("<|mask|>")


@pytest.mark.slow
def test_a_unigram_run_packs_pretrains_and_exports(tmp_path, capsys):
    """The spine (corpus, tokenizer, pack, pretrain) with tokenizer.model = "unigram", then `kiln export hf`."""
    transformers = pytest.importorskip("transformers")
    from kiln_testing.recipes import mini_overrides

    from kiln.cli import main
    from kiln.data.tokenizer import Tokenizer

    run = [
        f'run.out_dir="{tmp_path}"',
        "run.name=ug",
        *mini_overrides(max_steps=4, warmup_steps=1, every=4),
        'run.stages=["corpus","tokenizer","pack","pretrain"]',
        'tokenizer.model="unigram"',
        "tokenizer.vocab_size=1024",
        "corpus.max_bytes_per_source=40000",
        "train.compile=false",
    ]
    assert main(["run", "recipes/tiny.toml", *run]) == 0
    run_dir = tmp_path / "ug"
    stats = json.loads((run_dir / "tokenizer" / "stats.json").read_text())
    assert stats["model"] == "unigram" and stats["vocab_size"] == 1024
    tok = Tokenizer.load(run_dir / "tokenizer")
    for header in (run_dir / "pack" / "train").glob("*.json"):  # each document ends with <|endoftext|>
        meta = json.loads(header.read_text())
        tokens = np.fromfile(header.with_suffix(".bin"), dtype=meta["dtype"])
        assert int((tokens == tok.eot_id).sum()) == meta["documents"] and int(tokens.max()) < 1024
    assert json.loads((run_dir / "pretrain" / "summary.json").read_text())["steps"] == 4
    capsys.readouterr()
    assert main(["export", "hf", str(run_dir / "pretrain"), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in HARD:
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text
