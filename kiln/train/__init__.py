"""The training loop shared by every training stage, with its optimizers, schedules,
checkpoints and metrics."""

from kiln.train.checkpoint import CheckpointError, CheckpointManager, load_weights, save_weights
from kiln.train.config import TrainConfig
from kiln.train.optim import Lion, build_optimizer
from kiln.train.schedule import lr_at
from kiln.train.trainer import Trainer, next_token_loss

__all__ = ["CheckpointError", "CheckpointManager", "Lion", "TrainConfig", "Trainer", "build_optimizer",
           "load_weights", "lr_at", "next_token_loss", "save_weights"]
