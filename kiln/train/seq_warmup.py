"""Sequence-length warmup: the first steps of pretraining train on shorter windows.

Each packed row of seq_len tokens is cut into seq_len / length windows, so a step keeps its tokens
(and the learning rate, batch ramp and data order stay as they are) while its rows get shorter and
more numerous. Short windows are cheaper per token (attention is quadratic in length) and early
training sees many more, easier examples (Li et al. 2022, "The Stability-Efficiency Dilemma:
Investigating Sequence Length Warmup for Training GPT Models"). The length is a pure function of
the step, like the learning rate, so a resumed run cuts its batches exactly as the first one did.
"""

from __future__ import annotations

import torch

from kiln.errors import ConfigError
from kiln.train.config import TrainConfig

KEY = "train.seq_len_warmup_steps"


def window_len_at(step: int, cfg: TrainConfig) -> int:
    """Window length of optimizer step `step` (0-based): linear from seq_len_start to seq_len over
    seq_len_warmup_steps, rounded down to a divisor of seq_len, so rows split into whole windows
    and the run sees only a few distinct shapes (one compiled graph each)."""
    if step >= cfg.seq_len_warmup_steps:
        return cfg.seq_len
    target = cfg.seq_len_start + (cfg.seq_len - cfg.seq_len_start) * step / cfg.seq_len_warmup_steps
    return max(d for d in range(cfg.seq_len_start, cfg.seq_len + 1) if cfg.seq_len % d == 0 and d <= target)


def window_lengths(cfg: TrainConfig) -> list[int]:
    """The distinct window lengths of a run, shortest first (just seq_len when warmup is off)."""
    return sorted({window_len_at(step, cfg) for step in range(cfg.seq_len_warmup_steps + 1)})


def split_windows(batch: tuple[torch.Tensor, ...], length: int) -> tuple[torch.Tensor, ...]:
    """A pretraining batch (inputs, targets), each [rows, seq_len], as [rows * seq_len / length,
    length]. Targets stay each input's next token; a window's first tokens just lose the context
    before them."""
    rows, seq_len = batch[0].shape
    if length == seq_len:
        return batch
    return tuple(t.reshape(rows * (seq_len // length), length) for t in batch)


def check_applies(custom_objective: bool, pipelined: bool, cp: int, tp: int) -> None:
    """Refuse the layouts and stages the warmup cannot cut the windows of, by key."""
    if custom_objective:
        raise ConfigError(KEY, "cuts pretraining's next-token windows; this stage brings its own batches or loss")
    for name, on in (("pipeline parallelism (pp > 1)", pipelined), ("context parallelism (cp > 1)", cp > 1)):
        if on:  # both fix the sequence shape per rank or per microbatch before the loop starts
            raise ConfigError(KEY, f"is not supported with {name}: its shapes are fixed per run")
    if tp > 1:  # sequence-parallel regions shard the sequence dimension by tp
        raise ConfigError(
            KEY, "is not supported with tensor parallelism (tp > 1): sequence parallelism shards the windows"
        )
