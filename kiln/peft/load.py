"""The model of any checkpoint a stage leaves, PEFT training checkpoints included: the one loader
that `kiln generate`, `kiln serve`, `kiln eval`, `kiln export` and the next stage's init go through.

A LoRA or QLoRA stage's checkpoints hold the model as it trained: frozen base weights (NF4 codes for
QLoRA) plus LoRA matrices, under names a plain Transformer does not have. Their manifest carries the
recipe, whose [peft] table rebuilds that structure (the rank and scale, the quantisation block); the
state loads into it and the LoRA updates fold into plain weights (NF4 dequantised, as
merged_state_dict does), so the result is the same plain Transformer the stage's `merged/` holds.

Bottleneck adapters cannot fold into a Linear (a nonlinearity sits between their two matrices), so a
checkpoint with adapters loads as a Transformer with the adapter modules attached and frozen; their
width comes from the saved weights, so a later stage that trained on top of them (with any method)
loads the same way. Such a model has no plain-weights form: `plain_weights(..., adapters=False)`
refuses it by name.

kiln.model.weights reads the files (checksums, older layouts); this module sits above it because
rebuilding LoRA, NF4 and adapters needs kiln.peft.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kiln.checkpoint import MANIFEST_FILE, CheckpointError, resolve_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.families import new_model
from kiln.model.transformer import Transformer
from kiln.model.weights import load_weights
from kiln.peft.adapter import AdapterConfig, adapter_modules, apply_adapters
from kiln.peft.apply import lora_config
from kiln.peft.config import PeftConfig
from kiln.peft.lora import apply_lora
from kiln.peft.nf4 import quantize_base
from kiln.peft.peft_io import folded_state_dict

# Suffixes of state keys only a LoRA layer (A, B, the wrapped base) or an NF4 weight has.
_LORA_OR_NF4 = (".lora_A", ".lora_B", ".base.weight", ".codes")
_ADAPTER_DOWN = ".adapter.down.weight"


def adapter_width(state: dict, where) -> int | None:
    """The bottleneck width of the adapters in a state dict; None when it has none."""
    widths = {t.shape[0] for k, t in state.items() if k.endswith(_ADAPTER_DOWN)}
    if len(widths) > 1:
        raise CheckpointError(f"{where}: bottleneck adapters of different widths {sorted(widths)}")
    return widths.pop() if widths else None


def trained_peft(manifest: dict, where) -> PeftConfig:
    """The [peft] table of the recipe a checkpoint was trained under."""
    table = (manifest.get("recipe") or {}).get("peft")
    if not isinstance(table, dict):
        raise CheckpointError(
            f"{where}: holds LoRA/NF4 weights but its manifest has no recipe [peft] table to rebuild them with"
        )
    try:
        cfg = PeftConfig(**table)
        cfg.validate()
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: the recipe's [peft] table cannot be used ({err})") from None
    if cfg.method not in ("lora", "qlora"):
        raise CheckpointError(f"{where}: holds LoRA/NF4 weights but its recipe says peft.method = {cfg.method!r}")
    return cfg


def _fold_lora(cfg: ModelConfig, state: dict, manifest: dict, where) -> dict:
    """The state of a LoRA/QLoRA training checkpoint as plain weights (adapters, if any, kept)."""
    peft = trained_peft(manifest, where)
    model = Transformer(cfg)
    width = adapter_width(state, where)
    if width is not None:  # in the order a stage builds them: the init's adapters, then the stage's LoRA
        apply_adapters(model, AdapterConfig(hidden=width))
    if peft.method == "qlora":
        quantize_base(model, peft.nf4_block_size, peft.double_quant)
    apply_lora(model, lora_config(peft))
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise CheckpointError(
            f"{where}: the weights do not fit the recipe's [peft] table ({_first_line(err)})"
        ) from None
    return folded_state_dict(model)


def _first_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return lines[1].strip() if len(lines) > 1 else lines[0]


def plain_weights(path, adapters: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(model config, state dict, manifest) of any checkpoint, LoRA folded in and NF4 dequantised.
    adapters=False: refuse a checkpoint with bottleneck adapters (for formats that hold plain
    weights only); otherwise their weights stay in the state under their own names."""
    folder = resolve_checkpoint(path)
    where = folder / MANIFEST_FILE
    cfg, state, manifest = load_weights(folder)
    if any(k.endswith(_LORA_OR_NF4) for k in state):
        state = _fold_lora(cfg, state, manifest, where)
    if not adapters and adapter_width(state, where) is not None:
        raise CheckpointError(
            f'{folder}: has bottleneck adapters (peft.method = "adapter"), which cannot be merged into '
            f"plain weights; `kiln generate`, `kiln serve`, `kiln eval` and the next stage load this folder "
            f"as it is, and the adapters alone are in its stage's adapter/ folder (Kiln format)"
        )
    return cfg, state, manifest


def _load_state(model: nn.Module, state: dict, where) -> None:
    width = adapter_width(state, where)
    if width is not None and not adapter_modules(model):
        apply_adapters(model, AdapterConfig(hidden=width))
    model.load_state_dict(state)
    for p in model.parameters():  # as in a freshly built model; a stage's [peft] decides what trains
        p.requires_grad_(True)


def load_into(model: nn.Module, path) -> dict:
    """Load any checkpoint into a plain Transformer of its config, in place, attaching the adapters
    it has first. Returns the manifest; RuntimeError when the weights do not fit the model."""
    folder = resolve_checkpoint(path)
    _, state, manifest = plain_weights(folder)
    _load_state(model, state, folder)
    return manifest


def load_model(path) -> tuple[nn.Module, dict]:
    """The model of any Kiln checkpoint (folder, checkpoints root or stage folder), in eval mode, and
    its manifest: plain weights, or with its bottleneck adapters attached."""
    folder = resolve_checkpoint(path)
    cfg, state, manifest = plain_weights(folder)
    model = new_model(cfg)
    try:
        _load_state(model, state, folder)
    except RuntimeError as err:  # e.g. a stage's extra modules (a PPO critic: its policy/ is the model)
        raise CheckpointError(f"{folder}: the weights do not fit a Transformer ({_first_line(err)})") from None
    return model.eval(), manifest
