"""T5's span corruption (Raffel et al. 2020, sec. 3.1.4 and 3.3.4): the pretraining inputs and targets
of an encoder-decoder, made from plain packed token windows.

Of a window of L tokens, round(L * noise_density) are noise, in round(noise / mean_span_length)
spans; both the noise and the kept tokens are split into that many non-empty runs uniformly at
random, and the runs alternate, kept first. Each noise span is replaced in the input by one sentinel
token (the k-th span by the k-th sentinel); the target is each sentinel followed by the span it
replaced. Both end with eos:

    window   a b c d e f g h          noise: c d, g
    input    a b <s0> e f <s1> h eos
    target   <s0> c d <s1> g eos

The counts depend only on L, so every window of a pack gives inputs and targets of the same lengths
and batches need no padding. Which tokens are noise is drawn from a generator seeded per window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.data.tokenizer import SENTINEL
from kiln.errors import ConfigError, DataError

IGNORE = -100  # label of a position the loss skips (cross_entropy's ignore_index)


@dataclass(frozen=True)
class SpanLayout:
    """Lengths of one window's corruption: they are the same for every window of `length` tokens."""

    length: int
    noise: int
    spans: int

    @property
    def input_length(self) -> int:
        return self.length - self.noise + self.spans + 1

    @property
    def target_length(self) -> int:
        return self.noise + self.spans + 1


def span_layout(length: int, noise_density: float = 0.15, mean_span_length: float = 3.0) -> SpanLayout:
    if not 0 < noise_density < 1:
        raise ConfigError("noise_density", f"must be in (0, 1), got {noise_density}")
    if not mean_span_length >= 1:
        raise ConfigError("mean_span_length", f"must be >= 1, got {mean_span_length}")
    if length < 2:
        raise ConfigError("seq_len", f"span corruption needs windows of at least 2 tokens, got {length}")
    noise = min(max(round(length * noise_density), 1), length - 1)
    spans = max(round(noise / mean_span_length), 1)
    # Every span and every run of kept tokens between them must be non-empty.
    spans = min(spans, noise, length - noise)
    return SpanLayout(length, noise, spans)


def _random_segmentation(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """`total` split into `parts` positive lengths, every such split equally likely."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False)) if parts > 1 else np.array([], int)
    return np.diff(np.concatenate([[0], cuts, [total]]))


def noise_mask(layout: SpanLayout, rng: np.random.Generator) -> np.ndarray:
    """Boolean [length]: True where a token is noise. Runs alternate kept, noise, kept, ..., noise."""
    noise = _random_segmentation(layout.noise, layout.spans, rng)
    kept = _random_segmentation(layout.length - layout.noise, layout.spans, rng)
    runs = np.stack([kept, noise], axis=1).reshape(-1)
    return np.repeat(np.tile([False, True], layout.spans), runs)


def corrupt(tokens: np.ndarray, mask: np.ndarray, sentinels: np.ndarray, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """(input, target) of one window given its noise mask (see the module docstring)."""
    starts = mask & ~np.concatenate([[False], mask[:-1]])  # first token of each noise span
    span_index = np.cumsum(starts) - 1
    if span_index.max(initial=-1) >= len(sentinels):
        raise DataError(
            f"a window has {span_index.max() + 1} noise spans but the tokenizer has {len(sentinels)} sentinels"
        )
    keep_in_input = ~mask | starts
    inputs = np.where(starts, sentinels[span_index.clip(0)], tokens)[keep_in_input]
    # The target: the sentinel of each span, then the span's tokens.
    target_pos = np.flatnonzero(mask)
    target = np.insert(tokens[target_pos], np.flatnonzero(starts[target_pos]), sentinels[: int(starts.sum())])
    return np.append(inputs, eos), np.append(target, eos)


def sentinel_ids(tokenizer, count: int) -> np.ndarray:
    """Ids of the first `count` sentinels; a tokenizer without them is refused by name."""
    ids = [tokenizer.hf.token_to_id(SENTINEL.format(k)) for k in range(count)]
    if None in ids:
        first = ids.index(None)
        raise ConfigError(
            "tokenizer.sentinels",
            f"{tokenizer.path} has no {SENTINEL.format(first)}; span corruption needs {count} sentinel "
            f"tokens: train the tokenizer with tokenizer.sentinels >= {count}",
        )
    return np.array(ids, dtype=np.int64)


class SpanCorruptionSource:
    """Batches (encoder input [B, S], decoder input [B, T], labels [B, T]) from a TokenLoader's
    windows, for kiln.train.objective.seq2seq_loss. The decoder input is the target shifted right
    behind the start token (pad_id), as T5 trains. Window i of the stream (the loader counts them)
    is corrupted with a generator seeded by (seed, i), so a resumed run draws the same noise, and the
    validation set is the same every time it is read."""

    def __init__(
        self,
        loader,
        sentinels: np.ndarray,
        eos: int,
        start: int,
        seed: int,
        noise_density: float = 0.15,
        mean_span_length: float = 3.0,
    ):
        self.loader, self.sentinels, self.eos, self.start, self.seed = loader, sentinels, eos, start, seed
        self.layout = span_layout(loader.seq_len, noise_density, mean_span_length)
        if self.layout.spans > len(sentinels):
            raise ConfigError(
                "tokenizer.sentinels",
                f"windows of {loader.seq_len} tokens have {self.layout.spans} noise spans; the tokenizer has "
                f"{len(sentinels)} sentinels",
            )
        self.windows = 0  # windows of the training stream corrupted so far

    # The interface the Trainer reads from a batch source.
    vocab_size = property(lambda self: self.loader.vocab_size)
    bytes_per_token = property(lambda self: getattr(self.loader, "bytes_per_token", None))
    world_size = property(lambda self: getattr(self.loader, "world_size", 1))

    def _batch(self, inputs: torch.Tensor, first: int, stream: int):
        """The loader's input windows (its seq_len tokens; the shifted targets are not needed)."""
        pairs = []
        for row, window in enumerate(inputs.numpy()):
            rng = np.random.default_rng([self.seed, stream, first + row])
            pairs.append(corrupt(window, noise_mask(self.layout, rng), self.sentinels, self.eos))
        enc = torch.from_numpy(np.stack([p[0] for p in pairs]))
        labels = torch.from_numpy(np.stack([p[1] for p in pairs]))
        dec = torch.cat([torch.full_like(labels[:, :1], self.start), labels[:, :-1]], dim=1)
        return enc, dec, labels

    def __iter__(self):
        return self

    def __next__(self):
        inputs, _ = next(self.loader)
        batch = self._batch(inputs, self.windows, stream=0)
        self.windows += inputs.shape[0]
        return batch

    def validation_batches(self, limit: int = 0, row_multiple: int = 1):
        first = 0
        for inputs, _ in self.loader.validation_batches(limit, row_multiple):
            yield self._batch(inputs, first, stream=1)
            first += inputs.shape[0]

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict(), "span_windows": self.windows}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        self.windows = int(state["span_windows"])
