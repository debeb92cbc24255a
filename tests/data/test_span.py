"""T5 span corruption: the exact sentinel layout on a small example, and the noise density and mean
span length of the paper (0.15, 3) measured over many windows."""

import numpy as np
import pytest
import torch

from kiln.data.span import SpanCorruptionSource, corrupt, noise_mask, sentinel_ids, span_layout
from kiln.errors import ConfigError

SENTINELS = np.array([100, 101, 102, 103])
EOS = 0


def test_sentinel_layout_on_a_worked_example():
    tokens = np.array([10, 11, 12, 13, 14, 15, 16, 17])  # a b c d e f g h
    mask = np.array([0, 0, 1, 1, 0, 0, 1, 0], dtype=bool)  # noise: c d, and g
    inputs, targets = corrupt(tokens, mask, SENTINELS, EOS)
    assert inputs.tolist() == [10, 11, 100, 14, 15, 101, 17, 0]
    assert targets.tolist() == [100, 12, 13, 101, 16, 0]


def test_layout_counts_follow_the_paper():
    layout = span_layout(128)  # 0.15 * 128 = 19.2 -> 19 noise tokens in round(19 / 3) = 6 spans
    assert (layout.noise, layout.spans) == (19, 6)
    assert (layout.input_length, layout.target_length) == (128 - 19 + 6 + 1, 19 + 6 + 1)
    with pytest.raises(ConfigError, match="noise_density"):
        span_layout(128, noise_density=1.5)


def test_noise_density_and_mean_span_length_statistically():
    layout = span_layout(512)
    rng = np.random.default_rng(0)
    noise, spans, first_noise, lengths = 0, 0, 0, []
    for _ in range(400):
        mask = noise_mask(layout, rng)
        assert mask.shape == (512,) and not mask[0]  # kept tokens come first
        starts = mask & ~np.concatenate([[False], mask[:-1]])
        noise += mask.sum()
        spans += starts.sum()
        first_noise += np.flatnonzero(mask)[0]
        # Span lengths: runs of True.
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
        lengths += (edges[1::2] - edges[::2]).tolist()
    assert noise / (400 * 512) == pytest.approx(0.15, abs=0.002)
    assert noise / spans == pytest.approx(3.0, abs=0.05)
    assert np.mean(lengths) == pytest.approx(3.0, abs=0.05)
    # Spans are placed at random: on average the first one does not start at a fixed offset, and
    # varied lengths occur (the segmentation is uniform, not every span exactly 3 long).
    assert len(set(lengths)) > 5
    assert 10 < first_noise / 400 < 60


class _Loader:
    """A TokenLoader stand-in: windows 0..seq_len-1 offset by the batch number."""

    seq_len, vocab_size, batch = 32, 200, 2

    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        windows = torch.arange(self.batch * (self.seq_len + 1)).view(self.batch, -1) + 20 + self.n
        return windows[:, :-1], windows[:, 1:]

    def validation_batches(self, limit=0, row_multiple=1):
        for i in range(2):
            windows = torch.arange(self.batch * (self.seq_len + 1)).view(self.batch, -1) + 20 + i
            yield windows[:, :-1], windows[:, 1:]

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_source_batches_are_shifted_seeded_and_resumable():
    source = SpanCorruptionSource(_Loader(), np.arange(150, 160), eos=0, start=1, seed=3)
    enc, dec, labels = next(source)
    layout = source.layout
    assert enc.shape == (2, layout.input_length) and labels.shape == (2, layout.target_length)
    assert dec[:, 0].tolist() == [1, 1] and torch.equal(dec[:, 1:], labels[:, :-1])
    assert labels[0, 0].item() == 150  # targets start with the first sentinel
    state = source.state_dict()
    second = next(source)
    again = SpanCorruptionSource(_Loader(), np.arange(150, 160), eos=0, start=1, seed=3)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(second, next(again)))
    # Validation: the same batches on every read; a different seed draws different noise.
    first_read = [b[0] for b in source.validation_batches()]
    assert all(torch.equal(a, b[0]) for a, b in zip(first_read, source.validation_batches()))
    other = SpanCorruptionSource(_Loader(), np.arange(150, 160), eos=0, start=1, seed=4)
    assert not all(torch.equal(a, b[0]) for a, b in zip(first_read, other.validation_batches()))


def test_too_few_sentinels_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer.sentinels"):
        SpanCorruptionSource(_Loader(), np.arange(150, 151), eos=0, start=1, seed=0)  # 32 tokens: 2 spans

    class Tok:
        path = tmp_path / "tokenizer.json"

        class hf:
            @staticmethod
            def token_to_id(text):
                return {"<|sentinel_0|>": 16}.get(text)

    assert sentinel_ids(Tok, 1).tolist() == [16]
    with pytest.raises(ConfigError, match=r"no <\|sentinel_1\|>.*tokenizer.sentinels >= 2"):
        sentinel_ids(Tok, 2)


def test_tokenizer_training_adds_sentinels_after_the_fixed_specials(tmp_path):
    from kiln.data.config import TokenizerConfig
    from kiln.data.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer

    texts = ["def f(x):\n    return x + 1\n"] * 50
    train_tokenizer(texts, TokenizerConfig(vocab_size=600, sentinels=3), tmp_path, heldout=texts[:2])
    tok = Tokenizer.load(tmp_path / "tokenizer.json")
    assert sentinel_ids(tok, 3).tolist() == [len(SPECIAL_TOKENS) + k for k in range(3)]
    assert tok.encode("a<|sentinel_1|>b")[1] == len(SPECIAL_TOKENS) + 1  # one token in text too
    with pytest.raises(ConfigError, match="tokenizer.sentinels >= 4"):
        sentinel_ids(tok, 4)
    with pytest.raises(ConfigError, match="sentinels"):
        TokenizerConfig(vocab_size=600, sentinels=100).validate()
