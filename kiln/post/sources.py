"""Batch sources for post-training stages, with the TokenLoader interface the training loop uses:
endless iteration, `state_dict`/`load_state_dict` (exact resume), `validation_batches(limit)` for
validation: every held-out example (limit 0), else a fixed sample of limit batches spread over them.

`ExampleSource` serves fixed, pre-tokenised examples (SFT rows, preference pairs) shuffled per epoch;
`OnlineSource` asks a function for each batch (RL rollouts sampled from the current policy), seeded
by the batch index so a resumed run samples the same rollouts; with `steps_per_batch` > 1 it serves
each optimizer step's batches to that many consecutive steps. The Trainer binds it to itself
(`bind(trainer)`) once built, so the function samples from the live model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kiln.data.loader import rank_batches, spread_sample


class ExampleSource:
    def __init__(
        self,
        rows: list[tuple[torch.Tensor, ...]],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        vocab_size: int = 0,
    ):
        if not rows:
            raise ValueError("no examples to train on")
        self.rows, self.batch_size, self.rank, self.world_size = rows, batch_size, rank, world_size
        self.seed, self.shuffle, self.vocab_size = seed, shuffle, vocab_size
        self.bytes_per_token = None  # bits per byte is a pretraining measure
        self.global_batch = batch_size * world_size
        self.batches_per_epoch = max(1, len(rows) // self.global_batch)
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.rows))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.rows), generator=g)

    def _batch(self, order: torch.Tensor, index: int) -> tuple[torch.Tensor, ...]:
        # A global batch is global_batch consecutive examples of the epoch's order; rank r takes its
        # slice, so every rank advances the same state and resume works on any world size.
        start = index * self.global_batch + self.rank * self.batch_size
        picked = [self.rows[int(i)] for i in order[start : start + self.batch_size]]
        return tuple(torch.stack(parts) for parts in zip(*picked))

    def __iter__(self):
        while True:
            order = self._order(self.epoch)
            while self.position < self.batches_per_epoch:
                batch = self._batch(order, self.position)
                self.position += 1
                yield batch
            self.epoch, self.position = self.epoch + 1, 0

    def validation_batches(self, limit: int = 0, row_multiple: int = 1):
        """This rank's batches of the examples in their given order: all of them (limit 0), else a
        sample of limit * global_batch spread over them (kiln.data.loader.spread_sample)."""
        positions = spread_sample(len(self.rows), limit * self.global_batch)
        for chunk in rank_batches(positions, self.batch_size, self.rank, self.world_size, row_multiple):
            yield tuple(torch.stack(parts) for parts in zip(*(self.rows[int(i)] for i in chunk)))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "examples": len(self.rows), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("examples") != len(self.rows) or state.get("seed") != self.seed:
            raise ValueError(
                f"source state is for {state.get('examples')} examples with seed {state.get('seed')}, "
                f"this source has {len(self.rows)} with seed {self.seed}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class OnlineSource:
    """Each batch comes from make_batch(trainer, index, seed): the trainer the source is bound to,
    the batch's index and a seed derived from it. The batch counter is the whole state.

    With `steps_per_batch` = k > 1, the micro-batches of k consecutive optimizer steps are the same:
    the first step of each group of k asks make_batch for them (all before that step's update, so
    from one policy) and the next k - 1 steps get them again. make_batch's index counts the batches
    it was asked for, so k = 1 reads exactly as without grouping; a run resumed at a group boundary
    asks for the same indices, and one resumed inside a group is refused (the policy that sampled
    the group is gone)."""

    def __init__(
        self,
        make_batch: Callable[[Any, int, int], tuple[torch.Tensor, ...]],
        seed: int = 0,
        val_batches: list | None = None,
        vocab_size: int = 0,
        steps_per_batch: int = 1,
    ):
        if steps_per_batch < 1:
            raise ValueError(f"steps_per_batch must be >= 1, got {steps_per_batch}")
        self.make_batch, self.seed, self.vocab_size = make_batch, seed, vocab_size
        self.steps_per_batch = steps_per_batch
        self.val = val_batches or []
        self.world_size = 1  # every data-parallel rank evaluates all of self.val
        self.bytes_per_token = None
        self.batches = 0
        self.trainer = None
        self.reused: dict[int, tuple[torch.Tensor, ...]] = {}  # the current group's batches by micro-batch

    def bind(self, trainer) -> None:
        self.trainer = trainer

    def __iter__(self):
        if self.trainer is None:
            raise RuntimeError("an OnlineSource samples from its trainer's model: bind(trainer) first")
        while True:
            batch = self._batch(self.batches)
            self.batches += 1
            yield batch

    def _batch(self, position: int) -> tuple[torch.Tensor, ...]:
        if self.steps_per_batch == 1:
            return self.make_batch(self.trainer, position, self.seed * 1_000_003 + position)
        per_step = self.trainer.accum_steps  # micro-batches of one optimizer step
        step, micro = divmod(position, per_step)
        group, repeat = divmod(step, self.steps_per_batch)
        if repeat == 0:
            if micro == 0:
                self.reused = {}
            index = group * per_step + micro
            self.reused[micro] = self.make_batch(self.trainer, index, self.seed * 1_000_003 + index)
        elif micro not in self.reused:
            raise RuntimeError(
                f"step {step} reuses the batches sampled at step {group * self.steps_per_batch}, which this "
                f"run did not sample: resume at a multiple of {self.steps_per_batch} steps"
            )
        return self.reused[micro]

    def validation_batches(self, limit: int = 0, row_multiple: int = 1):
        """The validation batches: all of them (limit 0), else limit of them spread over the list."""
        if row_multiple != 1:
            raise ValueError("an OnlineSource's validation batches are built whole; they cannot be regrouped")
        for index in spread_sample(len(self.val), limit):
            yield self.val[int(index)]

    def state_dict(self) -> dict:
        return {"batches": self.batches, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.batches = int(state["batches"])
        self.reused = {}
