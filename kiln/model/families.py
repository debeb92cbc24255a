"""build_model, count_params and flops_per_token for a config of any model family ([model] arch):
each family's module (kiln/model/transformer.py, kiln/model/bert.py, kiln/model/t5.py) defines the
three, and new_model builds its module class."""

from __future__ import annotations

import torch

from kiln.model import bert, t5, transformer
from kiln.model.config import arch_of

MODULES = {"decoder": transformer, "bert": bert, "t5": t5}
CLASSES = {"decoder": transformer.Transformer, "bert": bert.Bert, "t5": t5.T5}


def build_model(cfg, device="cpu"):
    """The model of `cfg` on `device`: made on the meta device first (no memory, no wasted init), then
    allocated and initialised there, the path a sharded model takes (the decoder's also checks that
    its position tables fit the device)."""
    if arch_of(cfg) == "decoder":
        return transformer.build_model(cfg, device=device)
    with torch.device("meta"):
        model = CLASSES[arch_of(cfg)](cfg)
    model.to_empty(device=device)
    model.init_weights()
    return model


def count_params(model_or_cfg, non_embedding: bool = False, active: bool = False) -> int:
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    return MODULES[arch_of(cfg)].count_params(model_or_cfg, non_embedding=non_embedding, active=active)


def flops_per_token(cfg, seq_len: int) -> float:
    return MODULES[arch_of(cfg)].flops_per_token(cfg, seq_len)


def new_model(cfg):
    """The module of `cfg` with freshly initialised weights, on the default device."""
    return CLASSES[arch_of(cfg)](cfg)
