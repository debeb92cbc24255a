"""Small trained tokenizers. tests/conftest.py trains the shared ones once per run with these (the
`kiln_tokenizer` and `byte_tokenizer` fixtures); call them directly only for a tokenizer that must
differ from those (another vocabulary or training text) or where no fixture reaches."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from kiln_testing.text import stdlib_texts

TINY_VOCAB = 700


def train_tiny_tokenizer(
    out_dir: str | Path, texts: Iterable[str] | None = None, vocab_size: int = TINY_VOCAB, **config
):
    """Kiln's own BPE, as `kiln tokenizer` trains it (byte-level, SPECIAL_TOKENS at ids 0..n-1), on
    `texts` (default: stdlib_texts(), 40 modules x 6000 characters), saved as out_dir/tokenizer.json
    and loaded as a kiln.data.tokenizer.Tokenizer. `config` holds further TokenizerConfig fields."""
    from kiln.data.config import TokenizerConfig
    from kiln.data.tokenizer import Tokenizer, train_tokenizer

    texts = stdlib_texts() if texts is None else texts
    train_tokenizer(texts, TokenizerConfig(vocab_size=vocab_size, **config), Path(out_dir), heldout=[])
    return Tokenizer.load(out_dir)


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
