"""The unigram (SentencePiece-style) tokenizer model: `tokenizer.model = "unigram"`.

Trained with the Hugging Face `tokenizers` UnigramTrainer, then rebuilt with byte fallback, so the
saved tokenizer.json is an ordinary `tokenizers` Unigram model that `transformers` loads as it is.
Layout of the vocabulary: the reserved tokens (Kiln's special tokens and sentinels, at the ids the
BPE model gives them), `<unk>`, the 256 byte tokens `<0x00>`..`<0xFF>`, then the learned pieces.
"""

from __future__ import annotations

import json
import re

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from kiln.errors import ConfigError

UNK = "<unk>"
SPACE = "\u2581"  # "▁": SentencePiece's stand-in for a space, so pieces can carry their spaces
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
# A word with the one space before it, whitespace up to a line break, or a run of whitespace (kept
# apart from the next word but for its last space), as in the BPE pre-split: pieces never cross a
# word, and the text splits where kiln.data.tokenizer.text_pieces cuts long texts.
UNIGRAM_SPLIT = r" ?\S+|\s*[\r\n]+|\s+(?!\S)|\s+"
# Reserved, <unk> and byte tokens only ever come from the added-token match or byte fallback. They
# sit in the model's vocabulary (byte fallback looks its tokens up there), so a score this far below
# any learned piece keeps the segmentation from choosing them for literal text such as "<0x41>" or
# "<|endoftext|>" in a raw document: every printable ASCII character is a piece of its own
# (REQUIRED_CHARS), so that text always has a path through ordinary pieces.
_NEVER_CHOSEN = -1e4
REQUIRED_CHARS = [chr(c) for c in range(33, 127)] + ["\t", "\n", "\r", SPACE]
RESERVED_UNIGRAM = 1 + len(BYTE_TOKENS)  # <unk> and the byte tokens, beside the special tokens


def _pipeline(hf: HFTokenizer, normalization: str) -> HFTokenizer:
    if normalization == "nfkc":
        hf.normalizer = normalizers.NFKC()
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(UNIGRAM_SPLIT), behavior="isolated"),
            # prepend_scheme="never": no dummy space before the first word, so a text's first
            # character decodes back as it was (with one, a text starting with a space loses it).
            pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=False),
        ]
    )
    hf.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement=SPACE, prepend_scheme="never", split=False)]
    )
    return hf


def build_untrained_unigram(normalization: str) -> HFTokenizer:
    return _pipeline(HFTokenizer(models.Unigram()), normalization)


def unigram_trainer(vocab_size: int, reserved: list[str], show_progress: bool) -> trainers.UnigramTrainer:
    return trainers.UnigramTrainer(
        vocab_size=vocab_size - len(BYTE_TOKENS),  # the byte tokens are added after training
        special_tokens=reserved + [UNK],
        unk_token=UNK,
        initial_alphabet=REQUIRED_CHARS,
        show_progress=show_progress,
    )


def with_byte_fallback(trained: HFTokenizer, reserved: list[str], normalization: str) -> HFTokenizer:
    """The trained model rebuilt with the byte tokens after <unk> and byte fallback on: a character
    no piece covers becomes its UTF-8 bytes, never <unk>."""
    learned = trained.get_vocab(with_added_tokens=False)
    scores = dict(_model_vocab(trained))
    fixed = set(reserved) | {UNK} | set(BYTE_TOKENS)
    missing = [c for c in REQUIRED_CHARS if c not in learned]
    if missing:  # the trainer keeps its initial alphabet; the scores above rely on it
        raise RuntimeError(f"unigram trainer dropped required characters {missing!r}")
    vocab = [(token, _NEVER_CHOSEN) for token in reserved + [UNK] + BYTE_TOKENS]
    # A learned piece spelled like a byte token would decode as that byte, so it is left out.
    vocab += [
        (p, scores[p]) for p in sorted(learned, key=learned.get) if p not in fixed and not _BYTE_TOKEN.fullmatch(p)
    ]
    hf = _pipeline(HFTokenizer(models.Unigram(vocab, unk_id=len(reserved), byte_fallback=True)), normalization)
    hf.add_special_tokens(reserved)
    return hf


def _model_vocab(hf: HFTokenizer) -> list[tuple[str, float]]:
    # The trained model's scores are reachable only through its JSON.
    return [tuple(entry) for entry in json.loads(hf.to_str())["model"]["vocab"]]


def too_many_characters(err: Exception, distinct: int, vocab_size: int) -> ConfigError | None:
    """The trainer's "vocabulary is not large enough to contain all chars" as a named error: it keeps
    every character of the training text as a piece (it has no character_coverage option)."""
    if "not large enough to contain all chars" not in str(err):
        return None
    return ConfigError(
        "vocab_size",
        f"{vocab_size} is too small for the unigram model: the training text has {distinct} distinct "
        f"characters and each needs a piece, beside {RESERVED_UNIGRAM} byte/<unk> tokens and the special tokens",
    )
