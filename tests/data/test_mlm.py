"""Masked-LM inputs: BERT's rates (15% selected; of those 80% <|mask|>, 10% random, 10% unchanged)
measured on a large sample, labels only where selected, and masks that survive a resume."""

import numpy as np
import pytest
import torch

from kiln.data.loader import TokenLoader
from kiln.data.mlm import IGNORE_INDEX, MaskedLMSource, Masker, classification_rows, mask_id
from kiln.data.tokenizer import MASK, SPECIAL_TOKENS
from kiln.errors import DataError

VOCAB, SPECIAL, MASK_ID = 1000, list(range(16)), 6


def sample(rows=200, seq=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(16, VOCAB, (rows, seq), generator=g)
    tokens[:, ::50] = 0  # document ends: special, never to be predicted
    return tokens


def test_masking_rates_are_berts():
    tokens = sample()  # ~100k tokens: the standard error of the 15% rate is 0.0011
    inputs, labels = Masker(MASK_ID, VOCAB, SPECIAL, seed=0).mask(tokens, np.arange(len(tokens)))
    eligible = tokens != 0
    selected = labels != IGNORE_INDEX
    assert abs(selected[eligible].float().mean().item() - 0.15) < 0.005
    assert not selected[~eligible].any()  # special tokens are never selected
    picked_in, picked = inputs[selected], tokens[selected]  # ~15k selected tokens
    masked = (picked_in == MASK_ID).float().mean().item()
    unchanged = (picked_in == picked).float().mean().item()
    randomised = ((picked_in != MASK_ID) & (picked_in != picked)).float().mean().item()
    assert abs(masked - 0.8) < 0.015 and abs(unchanged - 0.1) < 0.012 and abs(randomised - 0.1) < 0.012
    assert not torch.isin(picked_in[picked_in != MASK_ID], torch.tensor(SPECIAL)).any()  # random = ordinary
    # Labels: the original token where selected, IGNORE_INDEX everywhere else; unselected inputs kept.
    assert torch.equal(labels[selected], picked)
    assert (labels[~selected] == IGNORE_INDEX).all()
    assert torch.equal(inputs[~selected], tokens[~selected])


def test_masks_depend_on_seed_and_row_key_only():
    tokens = sample(rows=4, seq=64)
    masker = Masker(MASK_ID, VOCAB, SPECIAL, seed=3)
    a = masker.mask(tokens, np.arange(4))
    b = Masker(MASK_ID, VOCAB, SPECIAL, seed=3).mask(tokens, np.arange(4))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # A row masks the same whatever batch it sits in: row key 2 alone equals row 2 of the batch.
    alone = masker.mask(tokens[2:3], np.array([2]))
    assert torch.equal(alone[1][0], a[1][2])
    other = Masker(MASK_ID, VOCAB, SPECIAL, seed=4).mask(tokens, np.arange(4))
    assert not torch.equal(other[1], a[1])
    assert not torch.equal(masker.mask(tokens, np.arange(4, 8))[1], a[1])


def test_source_masks_the_same_after_a_resume(tmp_path, tiny_pack_factory):
    pack = tiny_pack_factory(tmp_path)
    masker = Masker(5, 64, [0], seed=1)

    def source():
        return MaskedLMSource(TokenLoader(pack, seq_len=16, batch_size=4, seed=2), masker)

    first = source()
    [next(first) for _ in range(3)]
    state = first.state_dict()
    expected = [next(first) for _ in range(2)]
    resumed = source()
    resumed.load_state_dict(state)
    for (x, y), (x2, y2) in zip(expected, [next(resumed) for _ in range(2)]):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert (y != IGNORE_INDEX).any() and (x == 5).any()
    val = MaskedLMSource(TokenLoader(pack, split="val", seq_len=16, batch_size=4), masker)
    once, twice = list(val.validation_batches(2)), list(val.validation_batches(2))
    assert len(once) == 2 and all(torch.equal(a[1], b[1]) for a, b in zip(once, twice))


def test_kiln_tokenizer_has_the_mask_token(kiln_tokenizer, byte_tokenizer):
    assert mask_id(kiln_tokenizer) == SPECIAL_TOKENS.index(MASK) == 6
    with pytest.raises(DataError, match="has no <\\|mask\\|> token.*retrain the tokenizer"):
        Masker.for_tokenizer(byte_tokenizer)


def test_classification_rows_pad_and_mask(kiln_tokenizer):
    (tokens, mask, label), _ = classification_rows(kiln_tokenizer, ["hello world", "x" * 400], [1, 0], seq_len=12)
    n = 1 + len(kiln_tokenizer.encode("hello world"))
    assert tokens[0] == kiln_tokenizer.eot_id and int(label) == 1
    assert mask.tolist() == [1] * n + [0] * (12 - n)
    assert (tokens[n:] == kiln_tokenizer.pad_id).all()
