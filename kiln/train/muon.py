"""Muon for the blocks' weight matrices, AdamW for everything else (train.optimizer = "muon").

Muon orthogonalises each matrix's momentum (Newton-Schulz iterations), which only means something
for the 2-D weights of hidden layers. Embedding tables (one row per token, sparse gradients), the
vocabulary head, norm gains and biases keep AdamW, as in Keller Jordan's Muon, modded-nanogpt and
nanochat. Both halves are torch's own optimizers (torch.optim.Muon, torch >= 2.9; torch.optim.AdamW);
MuonAdamW only joins them so the trainer's schedule, gradient scaler and checkpoints see one optimizer.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.peft.adapter import adapter_modules
from kiln.peft.lora import lora_modules
from kiln.train.config import TrainConfig

# Keller Jordan's and nanochat's peak Muon lr under the "original" shape scaling; with
# "match_rms_adamw" (Moonshot) the update RMS matches AdamW's, so AdamW's lr carries over.
DEFAULT_MUON_LR = 0.02


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], set[int]]:
    """The trainable parameters Muon takes: the 2-D weights inside the repeated blocks (the modules
    of any nn.ModuleList: `layers` in every Kiln model), embedding tables excepted. What lies outside
    the blocks (token embeddings, the vocabulary head, the final norm) stays with AdamW.
    Returns them in model order and their ids."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    chosen, seen = [], set()
    for block_list in (m for m in model.modules() if isinstance(m, nn.ModuleList)):
        for p in block_list.parameters():
            if p.requires_grad and p.ndim == 2 and id(p) not in embedding_ids and id(p) not in seen:
                seen.add(id(p))
                chosen.append(p)
    return chosen, seen


class MuonAdamW:
    """torch.optim.Muon over `muon_params` and torch.optim.AdamW over `adamw_groups`.

    param_groups lists both optimizers' groups (Muon's first); each Muon group carries "lr_ratio"
    (muon_lr / lr), which the trainer multiplies into the scheduled lr, so Muon's lr follows the
    same warmup and decay from its own peak. state_dict() nests the two optimizers' own dicts.
    """

    def __init__(self, muon_params, adamw_groups, *, muon_kwargs: dict, adamw_kwargs: dict, lr_ratio: float):
        self.muon = torch.optim.Muon([{"params": muon_params, "lr_ratio": lr_ratio}], **muon_kwargs)
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_kwargs)
        # GradScaler.unscale_/step key their per-optimizer records by id(self) and read
        # param_groups, which is all a scaler needs from an optimizer.
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    def step(self, closure=None):
        loss = self.muon.step(closure)  # the closure (if any) is evaluated once, by Muon
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ConfigError("optimizer", "the checkpoint's optimizer state was not written by optimizer = 'muon'")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def build_muon(model: nn.Module, groups: list[dict], cfg: TrainConfig, foreach: bool) -> MuonAdamW:
    """Muon over muon_split(model); the rest of `groups` (kiln.train.optim.param_groups) to AdamW."""
    if lora_modules(model) or adapter_modules(model):
        raise ConfigError("optimizer", "muon trains full weight matrices; LoRA and adapters (peft) train with adamw")
    muon_params, muon_ids = muon_split(model)
    if not muon_params:
        raise ConfigError("optimizer", "muon: the model has no trainable 2-D block matrices")
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in muon_ids]} for g in groups]
    rest = [g for g in rest if g["params"]]
    if not rest:
        raise ConfigError("optimizer", "muon: no embedding, head or norm parameters left for AdamW")
    muon_lr = cfg.muon_lr or (DEFAULT_MUON_LR if cfg.muon_adjust_lr == "original" else cfg.lr)
    return MuonAdamW(
        muon_params,
        rest,
        muon_kwargs=dict(
            lr=muon_lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            ns_steps=cfg.muon_ns_steps,
            adjust_lr_fn=cfg.muon_adjust_lr,
        ),
        adamw_kwargs=dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        | ({"fused": True} if cfg.optimizer_impl == "fused" else {"foreach": foreach}),
        lr_ratio=muon_lr / cfg.lr,
    )
