"""Inputs of an encoder model (kiln/model/bert.py): masked-LM batches and classification rows.

Masked language modelling as in BERT (Devlin et al. 2019, sec. 3.1 and appendix A.1): of the
tokens that may be predicted (every token but the tokenizer's special ones), each is selected with
probability 0.15; a selected token is replaced by <|mask|> with probability 0.8, by a random
ordinary token with probability 0.1, and left as it is with probability 0.1. The labels hold the
original token at the selected positions and IGNORE_INDEX everywhere else, so the loss counts the
selected tokens only.

The three draws of a token are counter-based uniforms (kiln.data.loader.uniform_for_counters) of
(seed, the row's key, the position): the masks need no RNG state, so a resumed run masks exactly as
the uninterrupted one would have, on any number of ranks. A training row's key is its global
sequence number in the pack loader's stream; a validation row's is its place in the validation
batches, so every evaluation scores the same masked tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.data.loader import TokenLoader, uniform_for_counters
from kiln.data.tokenizer import MASK, SPECIAL_TOKENS, Tokenizer
from kiln.errors import DataError

SELECT_PROB = 0.15  # of the eligible tokens, the share the loss predicts
MASK_PROB = 0.8  # of the selected, the share replaced by <|mask|>
RANDOM_PROB = 0.1  # ... by a random ordinary token; the remaining 0.1 are left unchanged
IGNORE_INDEX = -100  # the label of a position the loss skips (torch's cross_entropy default)
DRAWS = 3  # uniforms per token: selection, replacement, the random token


def special_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids of the tokenizer's special tokens: Kiln's reserved ones and whatever roles its config
    names. They are never selected nor drawn as random replacements."""
    ids = {tokenizer.hf.token_to_id(t) for t in SPECIAL_TOKENS}
    ids |= {tokenizer.hf.token_to_id(t) for t in tokenizer.special.values() if t is not None}
    return sorted(i for i in ids if i is not None)


def mask_id(tokenizer: Tokenizer) -> int:
    token_id = tokenizer.hf.token_to_id(MASK)
    if token_id is None:
        raise DataError(
            f"{tokenizer.path}: has no {MASK} token, which masked-LM training puts in place of the tokens "
            f"it predicts; retrain the tokenizer (`kiln tokenizer train`: Kiln's tokenizers have it at id "
            f"{SPECIAL_TOKENS.index(MASK)} since it was added) or import one that has it"
        )
    return token_id


class Masker:
    """mask(tokens, row_keys) -> (inputs, labels), BERT's rates, deterministic in (seed, key, position)."""

    def __init__(self, mask_id: int, vocab_size: int, special: list[int], seed: int = 0):
        self.mask_id, self.vocab_size = mask_id, vocab_size
        # 2 * seed + 1 differs from seed: the pack loader draws its own uniforms under train.seed.
        self.seed = 2 * seed + 1
        self.special = np.asarray(sorted(special), dtype=np.int64)
        self.ordinary = np.setdiff1d(np.arange(vocab_size), self.special)
        if not len(self.ordinary):
            raise DataError(f"a vocabulary of {vocab_size} holds only special tokens: nothing to predict")

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, seed: int = 0) -> Masker:
        return cls(mask_id(tokenizer), tokenizer.vocab_size, special_ids(tokenizer), seed)

    def mask(self, tokens: torch.Tensor, row_keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        ids = tokens.numpy()
        rows, seq = ids.shape
        counters = np.asarray(row_keys, dtype=np.uint64)[:, None] * np.uint64(seq) + np.arange(seq, dtype=np.uint64)
        counters = counters * np.uint64(DRAWS)
        select, action, pick = (uniform_for_counters(self.seed, counters + np.uint64(k)) for k in range(DRAWS))
        selected = (select < SELECT_PROB) & ~np.isin(ids, self.special)
        masked = selected & (action < MASK_PROB)
        randomised = selected & (action >= MASK_PROB) & (action < MASK_PROB + RANDOM_PROB)
        random_tokens = self.ordinary[(pick * len(self.ordinary)).astype(np.int64)]
        inputs = np.where(masked, self.mask_id, np.where(randomised, random_tokens, ids))
        labels = np.where(selected, ids, IGNORE_INDEX)
        return torch.from_numpy(inputs.astype(np.int64)), torch.from_numpy(labels.astype(np.int64))


class MaskedLMSource:
    """A pack loader's batches as (masked inputs, labels), with the loader's interface (iteration,
    state_dict/load_state_dict, validation_batches, vocab_size, world_size). Resume is the loader's:
    the masks follow from its position."""

    def __init__(self, loader: TokenLoader, masker: Masker):
        self.loader, self.masker = loader, masker
        self.vocab_size, self.world_size = loader.vocab_size, loader.world_size
        self.bytes_per_token = None  # a masked-token loss is not a language model's bits per byte

    def __iter__(self) -> MaskedLMSource:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.loader.split != "train":
            raise ValueError("a masked-LM validation source is read through validation_batches()")
        # The rows of this rank in the global batch about to be drawn: their global sequence numbers.
        first = self.loader.sequences + self.loader.rank * self.loader.batch_size
        inputs, _ = next(self.loader)
        return self.masker.mask(inputs, first + np.arange(inputs.shape[0]))

    def validation_batches(self, limit: int = 0, row_multiple: int = 1):
        rank, world, batch = self.loader.rank, self.loader.world_size, self.loader.batch_size
        for i, (inputs, _) in enumerate(self.loader.validation_batches(limit, row_multiple)):
            yield self.masker.mask(inputs, (i * world + rank) * batch + np.arange(inputs.shape[0]))

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def classification_rows(
    tokenizer: Tokenizer, texts: list[str], labels: list[int], seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(tokens [seq_len], attention_mask [seq_len], label) per text, for a sequence classifier: the
    text after <|endoftext|> (the first token, whose state the pooler reads, as BERT's [CLS]), cut
    to seq_len and padded with <|pad|>, which the mask hides."""
    if len(texts) != len(labels):
        raise DataError(f"{len(texts)} texts but {len(labels)} labels")
    if tokenizer.pad_id is None:
        raise DataError(f"{tokenizer.path}: has no pad token to pad classification rows with")
    rows = []
    for text, label in zip(texts, labels):
        ids = ([tokenizer.prefix_id] + tokenizer.encode(text, parse_special=False))[:seq_len]
        mask = [1] * len(ids) + [0] * (seq_len - len(ids))
        ids = ids + [tokenizer.pad_id] * (seq_len - len(ids))
        rows.append((torch.tensor(ids), torch.tensor(mask), torch.tensor(label)))
    return rows
