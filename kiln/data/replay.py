"""Replay for continual pretraining: a share of every training batch from an earlier run's pack.

Global training sequence g (counted over both packs and all ranks) comes from the replay pack iff
floor((g + 1) * f) > floor(g * f), f being the replay fraction. So after n sequences exactly
floor(n * f) were replayed, spread evenly through the stream; every global batch holds the floor or
the ceiling of f times its size; and the choice is a function of g alone, so a resumed run needs no
state beyond the two packs' own loader states. Within each pack the order is TokenLoader's (its
mixture weights, per-source epochs and seeded permutations).

Both packs must come from one tokenizer: a token id means the same text in each, else replaying
the old pack would teach the model noise.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.data.loader import TokenLoader
from kiln.errors import DataError


def replayed(start: int, count: int, fraction: float) -> np.ndarray:
    """Which of global sequences start .. start + count - 1 come from the replay pack."""
    g = np.arange(start, start + count, dtype=np.float64)
    return np.floor((g + 1) * fraction) > np.floor(g * fraction)


def check_same_tokenizer(new: TokenLoader, old: TokenLoader) -> None:
    """Refuse two packs whose token ids do not mean the same text (the shard headers' tokenizer)."""
    for key in ("tokenizer_sha256", "vocab_size"):
        mine, theirs = getattr(new, key), getattr(old, key)
        if mine != theirs:
            raise DataError(
                f"{old.pack_dir}: {key} {theirs!r} differs from {new.pack_dir}'s {mine!r}; replay needs "
                f"both packs made with one tokenizer (pack the new data with the earlier run's tokenizer)"
            )


class ReplayLoader:
    """The train stream of `new` with a `fraction` of its sequences drawn from `old` instead; the
    interface of a train TokenLoader (iteration, state_dict/load_state_dict, vocab_size)."""

    def __init__(self, new: TokenLoader, old: TokenLoader, fraction: float):
        if new.split != "train" or old.split != "train":
            raise ValueError("ReplayLoader mixes two train splits")
        if not 0 <= fraction < 1:
            raise ValueError(f"replay fraction must be in [0, 1), got {fraction}")
        check_same_tokenizer(new, old)
        if (old.seq_len, old.batch_size, old.rank, old.world_size) != (
            new.seq_len,
            new.batch_size,
            new.rank,
            new.world_size,
        ):
            raise ValueError("the replay loader must have the new loader's seq_len, batch size and ranks")
        self.new, self.old, self.fraction = new, old, fraction
        self.split = "train"
        self.batch_size, self.rank, self.world_size = new.batch_size, new.rank, new.world_size
        self.global_batch = new.global_batch
        self.vocab_size, self.tokenizer_sha256 = new.vocab_size, new.tokenizer_sha256

    @property
    def sequences(self) -> int:
        """Global sequences drawn so far from both packs."""
        return self.new.sequences + self.old.sequences

    def __iter__(self) -> "ReplayLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        from_old = replayed(self.sequences, self.global_batch, self.fraction)
        # Each sequence's place in its own pack's share of the global batch.
        place = np.where(from_old, np.cumsum(from_old) - 1, np.cumsum(~from_old) - 1)
        mine = range(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        n_old = int(from_old.sum())
        old = iter(self.old.draw(n_old, {int(place[j]) for j in mine if from_old[j]}))
        new = iter(self.new.draw(self.global_batch - n_old, {int(place[j]) for j in mine if not from_old[j]}))
        return TokenLoader._to_tensors([next(old) if from_old[j] else next(new) for j in mine])

    def state_dict(self) -> dict:
        return {"replay_fraction": self.fraction, "new": self.new.state_dict(), "old": self.old.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "replay_fraction" not in state:
            raise DataError(
                "loader state is of a run without train.replay; resuming with replay would not "
                "continue the same stream (start a new run, e.g. with init_from)"
            )
        if state["replay_fraction"] != self.fraction:
            raise DataError(
                f"loader state has replay fraction {state['replay_fraction']} but this run has "
                f"{self.fraction}; resuming would not continue the same stream"
            )
        self.new.load_state_dict(state["new"])
        self.old.load_state_dict(state["old"])
