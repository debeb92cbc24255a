"""Learning-rate schedules: a pure function of the step, so resuming needs no scheduler state.

Convention: optimizer step `step` (0-based) uses the learning rate reached after step + 1 steps of
the schedule. So the first step already gets lr / warmup_steps (not zero, which would waste a
step), the last warmup step gets the peak, and the last step of the run (max_steps - 1) lands
exactly on the floor lr * min_lr_ratio.
"""

from __future__ import annotations

import math

from kiln.errors import ConfigError
from kiln.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    peak = cfg.lr
    floor = cfg.lr * cfg.min_lr_ratio
    done = step + 1  # steps of the schedule completed once this one is taken
    warmup = cfg.warmup()
    if done <= warmup:
        # Linear warmup: Adam's second-moment estimates are noisy for the first steps, and a
        # full-size update from them can push the freshly initialised network into a bad region.
        return peak * done / warmup
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        span = cfg.max_steps - warmup
        progress = min(1.0, (done - warmup) / span)
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "wsd":
        # Warmup-stable-decay (Hu et al. 2024, MiniCPM): hold the peak, then decay over the last
        # decay_fraction of the run. The decay is 1 - sqrt, which Hägele et al. 2024 ("Scaling Laws
        # and Compute-Optimal Training Beyond Fixed Training Durations") found to match or beat
        # cosine, while linear decay does slightly worse. Because the stable phase does not depend
        # on max_steps, a run can be extended and decayed later from any stable checkpoint.
        decay_steps = max(1, round(cfg.decay_fraction * cfg.max_steps))
        decay_start = max(warmup, cfg.max_steps - decay_steps)
        if done <= decay_start:
            return peak
        progress = min(1.0, (done - decay_start) / (cfg.max_steps - decay_start))
        return floor + (peak - floor) * (1.0 - math.sqrt(progress))
    raise ConfigError("schedule", f"must be one of cosine, wsd, constant, got {cfg.schedule!r}")
