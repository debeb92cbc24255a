"""The training loop shared by every training stage, with its optimizers, schedules and metrics
(checkpoints are the bottom layer's kiln.checkpoint).

Everything but the config is imported on first use, so that loading a recipe (which imports
TrainConfig) does not import torch.
"""

from importlib import import_module

from kiln.train.config import GuardConfig, TrainConfig

_LOCATIONS = {
    "Lion": "optim",
    "build_optimizer": "optim",
    "lr_at": "schedule",
    "Trainer": "trainer",
    "next_token_loss": "objective",
    "Watchdog": "watchdog",
    "WATCHDOG_EXIT_CODE": "watchdog",
}


def __getattr__(name: str):
    if name in _LOCATIONS:
        return getattr(import_module(f"kiln.train.{_LOCATIONS[name]}"), name)
    raise AttributeError(f"module 'kiln.train' has no attribute {name!r}")


__all__ = ["GuardConfig", "TrainConfig", *_LOCATIONS]
