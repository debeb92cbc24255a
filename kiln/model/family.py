"""The model of a config, whatever its family: the torch side of kiln.model.arch. The trainer, the
checkpoint loader and the engine build models through here, so a family is one entry per function."""

from __future__ import annotations

import torch.nn as nn

from kiln.model import t5, transformer
from kiln.model.t5_config import T5Config


def new_model(cfg) -> nn.Module:
    """The module of `cfg` with freshly initialised weights, on the default device."""
    return t5.T5(cfg) if isinstance(cfg, T5Config) else transformer.Transformer(cfg)


def build_model(cfg, device="cpu") -> nn.Module:
    if isinstance(cfg, T5Config):
        return t5.build_t5(cfg, device)
    return transformer.build_model(cfg, device)


def count_params(model_or_cfg, non_embedding: bool = False, active: bool = False) -> int:
    cfg = model_or_cfg.cfg if isinstance(model_or_cfg, nn.Module) else model_or_cfg
    if isinstance(cfg, T5Config):  # dense: every parameter is active
        return t5.t5_count_params(cfg, non_embedding)
    return transformer.count_params(model_or_cfg, non_embedding, active)


def flops_per_token(cfg, seq_len: int) -> float:
    if isinstance(cfg, T5Config):
        return t5.t5_flops_per_token(cfg, seq_len)
    return transformer.flops_per_token(cfg, seq_len)
