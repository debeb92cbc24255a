"""Small trained tokenizers; tests/conftest.py trains the shared ones once per run (the
`byte_tokenizer` fixture) with these functions."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def train_byte_bpe(path: str | Path, texts: Sequence[str], vocab_size: int, special_tokens=("<|endoftext|>",)):
    """A bare byte-level BPE from the tokenizers library (no Kiln special tokens beyond
    `special_tokens`, which take ids 0..n-1), for tests whose model has a fixed small vocabulary.
    Saved to `path` (a tokenizer.json); returns the tokenizers.Tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    hf.save(str(path))
    return hf
