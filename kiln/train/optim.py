"""Optimizers: AdamW and Adafactor from torch, Lion written here, with one rule for weight decay."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.train.config import TrainConfig
from kiln.train.muon import MuonAdamW, build_muon
from kiln.train.offload import DEFAULT_CHUNK_MB, NVMeAdamW

# Devices with torch's fused AdamW kernel that Kiln trains on (torch >= 2.4 has the CPU one).
FUSED_DEVICES = frozenset({"cpu", "cuda"})


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Decay applies to the weight matrices of linear layers (the output head included) only:
    - norm gains and biases (ndim < 2) set scale and offset; shrinking them towards zero
      fights the normalisation rather than regularising capacity;
    - embedding tables are left alone too: a row only receives gradient when its token occurs,
      but decoupled decay shrinks every row on every step, so rare tokens' embeddings would be
      pulled to zero between their occurrences (OLMo 2 removed embedding decay for stability).
      A tied output head shares the embedding tensor and follows the embedding's rule.
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    seen = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim >= 2 and id(p) not in embedding_ids:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _check_fused_devices(devices: set[str]) -> None:
    if not devices <= FUSED_DEVICES:
        raise ConfigError(
            "optimizer_impl", f"fused AdamW runs on {', '.join(sorted(FUSED_DEVICES))}, not {sorted(devices)}"
        )


def build_optimizer(model: nn.Module, cfg: TrainConfig, offload_dir=None) -> torch.optim.Optimizer | MuonAdamW:
    """The optimizer named by cfg.optimizer, over `param_groups(model, cfg.weight_decay)`.

    The learning rate set here is the peak; the trainer overwrites group["lr"] every step
    from the schedule (kiln.train.schedule.lr_at). With cfg.optimizer_offload = "nvme", AdamW's
    moments go to swap files under cfg.optimizer_offload_dir, or offload_dir when that is empty.
    """
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ConfigError("optimizer", "the model has no trainable parameters")
    devices = {p.device.type for g in groups for p in g["params"]}
    foreach = devices <= {"cpu", "cuda"}
    if cfg.optimizer == "muon":  # its AdamW part (embeddings, head, norms) follows optimizer_impl
        if cfg.optimizer_impl == "fused":
            _check_fused_devices(devices)
        return build_muon(model, groups, cfg, foreach)
    if cfg.optimizer == "adamw":
        # foreach batches the update over all tensors (few large ops instead of a Python loop of
        # small ones) and gives bit-identical results to the single-tensor reference
        # (tests/train/test_optim.py). fused runs one kernel per tensor list that reads and writes
        # each element once; it computes the same formula in a different order of operations, so it
        # is not bit-equal to the reference, only to itself (docs/pretrain.md "AdamW implementation").
        if cfg.optimizer_offload == "nvme":
            return _nvme_adamw(groups, cfg, offload_dir, foreach)
        hyper = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        if cfg.optimizer_impl == "fused":
            _check_fused_devices(devices)
            return torch.optim.AdamW(groups, **hyper, fused=True)
        return torch.optim.AdamW(groups, **hyper, foreach=foreach)
    if cfg.optimizer == "lion":
        return Lion(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    if cfg.optimizer == "adafactor":
        # torch's Adafactor keeps factored second moments and no first moment (beta1 unused);
        # lr caps its relative step size (min(lr, 1/sqrt(t)) times the parameter RMS).
        return torch.optim.Adafactor(groups, lr=cfg.lr)
    raise ConfigError("optimizer", f"must be one of adamw, lion, adafactor, muon, got {cfg.optimizer!r}")


def _nvme_adamw(groups: list[dict], cfg: TrainConfig, offload_dir, foreach: bool) -> NVMeAdamW:
    target = cfg.optimizer_offload_dir or offload_dir
    if not target:
        raise ConfigError("optimizer_offload_dir", "nvme offload needs a folder for its swap files")
    folder = Path(target)
    try:
        return NVMeAdamW(
            groups,
            folder,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            chunk_bytes=(cfg.optimizer_offload_chunk_mb or DEFAULT_CHUNK_MB) << 20,
            foreach=foreach,
        )
    except OSError as err:
        raise ConfigError(
            "optimizer_offload_dir", f"{folder}: cannot write swap files there ({err.strerror or err})"
        ) from None


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2).

    Per parameter, with gradient g and momentum m:
        update = sign(beta1 * m + (1 - beta1) * g)
        p      = p - lr * (update + weight_decay * p)      (decoupled decay)
        m      = beta2 * m + (1 - beta2) * g
    The update has unit magnitude per coordinate, so Lion wants a learning rate 3-10x smaller
    than AdamW's and a weight decay 3-10x larger to keep lr * weight_decay similar (paper, sec. 5).
    """

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr <= 0:
            raise ValueError(f"Lion: lr must be positive, got {lr}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lion: betas must be in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, weight_decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                update = exp_avg.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
                if weight_decay:
                    p.mul_(1 - lr * weight_decay)
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss
