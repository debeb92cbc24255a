"""Loss-spike and NaN guard of the training loop (`[train.guard]`).

After the backward pass and before the optimizer step, the step's loss and gradient norm are
checked. A step is flagged when either is not finite ("nan"), or when its loss rises above the mean
of the last `window` accepted losses by more than `spike_sigma` standard deviations and by at least
`spike_min_rise` ("spike"). A flagged step never updates the weights; then, by `action`:

- "skip": the step is dropped (no optimizer step, gradients zeroed); its data is consumed and the
  step counter advances, so the run moves on to the next batch.
- "rollback": the weights, optimizer and grad-scaler state of the newest checkpoint are reloaded, and
  the data loader stays where it is, past every batch read since that checkpoint (the window that
  led to the spike). The step counter keeps counting, so logs, schedule and checkpoints stay
  monotonic; the learning rate is multiplied by `lr_factor` from then on.
- "off": nothing is checked (and the loop needs no device sync per step).

GuardConfig lives in kiln.train.config, which the recipe loader imports without torch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kiln.checkpoint import load_sharded
from kiln.errors import TrainingDiverged
from kiln.parallel.grad import total_grad_norm
from kiln.train.config import GuardConfig


@dataclass
class GuardEvent:
    type: str  # "nan" | "spike"
    details: dict  # loss, grad_norm, and for a spike the rolling mean and std it was compared with


class LossGuard:
    """Flags bad steps from their loss and gradient norm; keeps the rolling history of good ones.

    `scaler_handles_overflow`: under fp16 dynamic loss scaling an inf/NaN gradient with a finite
    loss is routine (the scale grew too large): the grad scaler skips that step and halves the scale
    itself, so the guard does not count it as an event.
    """

    def __init__(self, cfg: GuardConfig, scaler_handles_overflow: bool = False):
        self.cfg = cfg
        self.scaler_handles_overflow = scaler_handles_overflow
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.events = 0

    @property
    def enabled(self) -> bool:
        return self.cfg.action != "off"

    def check(self, loss: float, grad_norm: float) -> GuardEvent | None:
        """The event for this step, or None if it is good (its loss then joins the history)."""
        details = {"loss": loss, "grad_norm": grad_norm}
        if not math.isfinite(loss) or (not math.isfinite(grad_norm) and not self.scaler_handles_overflow):
            return self._flag(GuardEvent("nan", details))
        spike = self.spike_stats(loss)
        if spike is not None:
            return self._flag(GuardEvent("spike", {**details, **spike}))
        if math.isfinite(grad_norm):
            # A step the grad scaler skips (overflowed gradients) did not train: its loss says
            # nothing about the current weights beyond the previous step's.
            self.history.append(loss)
        return None

    def spike_stats(self, loss: float) -> dict | None:
        """{"mean", "std", "sigma"} if `loss` is a spike against the history, else None."""
        if self.cfg.spike_sigma == 0 or len(self.history) < self.cfg.min_history:
            return None
        n = len(self.history)
        mean = math.fsum(self.history) / n
        # Sample standard deviation (n - 1): the window is a sample of the recent loss noise.
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in self.history) / (n - 1))
        rise = loss - mean
        if rise > self.cfg.spike_sigma * std and rise > self.cfg.spike_min_rise:
            return {"mean": mean, "std": std, "sigma": rise / std if std > 0 else math.inf}
        return None

    def _flag(self, event: GuardEvent) -> GuardEvent:
        self.events += 1
        return event

    def exhausted(self) -> bool:
        return self.cfg.max_events > 0 and self.events > self.cfg.max_events

    def state_dict(self) -> dict:
        return {"history": list(self.history), "events": self.events}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque((float(x) for x in state.get("history", ())), maxlen=self.cfg.window)
        self.events = int(state.get("events", 0))


# ---- the loop's response (kiln.train.trainer.Trainer calls these) ----------------------------------


def respond(trainer, event: GuardEvent) -> None:
    """The guard flagged the step the trainer just took (its update was not applied): log it, then
    skip or roll back; stop the run once more steps were flagged than max_events allows."""
    cfg = trainer.cfg.guard
    trainer._event(event.type, action=cfg.action, **event.details)
    if trainer.guard.exhausted():
        raise TrainingDiverged(
            f"step {trainer.step}: the loss guard flagged {trainer.guard.events} steps, more than "
            f"train.guard.max_events={cfg.max_events}; the run is diverging. Lower train.lr, look at the "
            f"data around this step, or resume from an earlier checkpoint"
        )
    if cfg.action == "rollback":
        rolled = rollback(trainer)
        if rolled is not None:
            trainer._event("rollback", **rolled)
            if cfg.lr_factor != 1.0:
                trainer.lr_scale *= cfg.lr_factor
                trainer._event("lr_lowered", lr_scale=trainer.lr_scale, lr_factor=cfg.lr_factor)
            return
        trainer._event("skip", reason="no checkpoint to roll back to yet")
        return
    trainer._event("skip")


def rollback(trainer) -> dict | None:
    """Reload model, optimizer and grad scaler from the trainer's newest checkpoint; the loader keeps
    its position, past every batch read since (the data window that led to the event). None if
    there is no checkpoint yet."""
    if trainer.sharded_saver is not None:
        trainer.sharded_saver.finish()
    found = trainer.ckpt.load_newest_valid(quarantine=trainer.is_main)
    if found is None:
        return None
    folder, manifest, model_state, train_state = found
    if model_state is None:  # sharded: every rank reads its shards
        load_sharded(folder, trainer.model, trainer.optimizer)
    else:
        trainer.model.load_state_dict(model_state)
        trainer.layout.load_full_optimizer_state(trainer.model, trainer.optimizer, train_state["optimizer"])
    if train_state["scaler"]:
        trainer.scaler.load_state_dict(train_state["scaler"])
    ckpt_step = int(manifest["step"])
    skipped = sum(trainer.accum_at(t) for t in range(ckpt_step, trainer.step))
    return {
        "checkpoint": folder.name,
        "checkpoint_step": ckpt_step,
        "skipped_steps": trainer.step - ckpt_step,
        "skipped_micro_batches": skipped,
        "skipped_tokens": skipped * trainer.tokens_per_micro_step,
    }


# ---- gradient norms per layer group (logged with the guard's statistics) ------------------------

GRAD_GROUPS = ("embed", "attn", "mlp", "norm", "head", "other")


def grad_group(name: str) -> str:
    """The layer group of a parameter, from its name in kiln.model.Transformer or Bert (also under
    LoRA or a wrapper's prefix): token/position/type embeddings, attention, feed-forward (MoE), norms
    (q/k norms inside attention too), the output head (a reward model's scalar head too), the rest."""
    parts = name.split(".")
    modules = parts[:-1]
    if any(p == "norm" or p.endswith("_norm") for p in modules):
        return "norm"
    if any(p in ("tok_embeddings", "pos_embeddings", "type_embeddings") for p in modules):
        return "embed"
    if "attn" in modules:
        return "attn"
    if "ffn" in modules:
        return "mlp"
    if "output" in modules:
        return "head"
    return "other"


def group_grad_norms(model, groups: list[str], layout, device):
    """The 2-norm of the gradients of each group in `groups`, as one tensor (no device sync)."""
    import torch

    members = {g: [] for g in groups}
    for name, p in model.named_parameters():
        if p.grad is not None:
            members.setdefault(grad_group(name), []).append(p)
    squares = []
    for group in groups:
        params = members[group]
        if not params:  # a pipeline rank without this group's layers
            squares.append(torch.zeros((), device=device))
        elif layout.sharded:  # DTensor gradients: the norm reduces over their mesh
            squares.append(total_grad_norm(params).float().square().to(device))
        else:
            squares.append(torch.nn.utils.get_total_norm([p.grad for p in params]).float().square().to(device))
    squares = torch.stack(squares)
    if layout.pp_mesh is not None:  # pipeline stages hold disjoint layers
        import torch.distributed as dist

        dist.all_reduce(squares, group=layout.pp_mesh.get_group())
    return squares.sqrt()
