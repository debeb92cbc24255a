"""The model side of a checkpoint: the manifest's model config as a ModelConfig, older fused-row
layouts converted to the current one. The file format itself (kiln.checkpoint) knows nothing of the
model; the model of a checkpoint, PEFT training checkpoints included, is kiln.peft.load.load_model."""

from __future__ import annotations

import dataclasses

import torch

from kiln.checkpoint import (
    MANIFEST_FILE,
    WEIGHTS_LAYOUT,
    CheckpointError,
    load_sharded_weights,
    load_single_file_state,
    read_manifest,
    resolve_checkpoint,
    verify,
)
from kiln.checkpoint.safety import check_sharded_pickles
from kiln.errors import ConfigError
from kiln.model.config import ModelConfig, RopeScaling, arch_of, model_family
from kiln.model.transformer import fuse_qkv


def model_config_from_dict(d: dict, where: str) -> ModelConfig:
    """The config of any model family (its `arch` key; none for the decoder)."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: model_config is {type(d).__name__}, not a table of model settings")
    try:
        cls, d = model_family(d)
    except ConfigError as err:
        raise CheckpointError(f"{where}: model_config.{err}") from None
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CheckpointError(f"{where}: model_config has unknown keys {unknown} (written by a newer Kiln?)")
    scaling = d.get("rope_scaling")
    if isinstance(scaling, dict):  # written by dataclasses.asdict
        rope_known = {f.name for f in dataclasses.fields(RopeScaling)}
        if set(scaling) - rope_known:
            raise CheckpointError(
                f"{where}: model_config.rope_scaling has unknown keys {sorted(set(scaling) - rope_known)}"
            )
        d = {**d, "rope_scaling": RopeScaling(**scaling)}
    return cls(**d)


def split_gate_up(w13: torch.Tensor, layout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) rows of a fused SwiGLU matrix as weights layouts 1 ([gate; up]) and 2 (gate and up
    rows interleaved) stored them; the rows are the second-to-last dimension (experts stack first)."""
    if layout == 1:
        return w13.chunk(2, dim=-2)
    pairs = w13.unflatten(-2, (-1, 2))
    return pairs[..., 0, :], pairs[..., 1, :]


def upgrade_layout(state: dict, manifest: dict) -> dict:
    """Convert a state dict saved with an older fused-row layout to the current one (in place).
    The manifest's model config is checked first, whatever the layout: a checkpoint written by a
    newer Kiln (unknown keys) is refused, and resume=auto falls back to an older one."""
    model_cfg = model_config_from_dict(manifest["model_config"], MANIFEST_FILE)
    layout = manifest.get("weights_layout", 1)
    if layout >= WEIGHTS_LAYOUT or arch_of(model_cfg) != "decoder":
        return state
    q_rows, kv_rows = model_cfg.n_heads * model_cfg.head_dim, model_cfg.kv_heads * model_cfg.head_dim
    for i in range(model_cfg.n_layers):
        for suffix in ("weight", "bias"):
            name = f"layers.{i}.attn.wqkv.{suffix}"
            if name in state and layout == 1:
                state[name] = fuse_qkv(*state[name].split([q_rows, kv_rows, kv_rows]), model_cfg.kv_heads)
    # Layouts 1 and 2 fused SwiGLU's gate and up rows into one w13 (dense FFN, shared expert, experts).
    for name in [n for n in state if n.endswith((".w13", ".w13.weight"))]:
        gate, up = split_gate_up(state.pop(name), layout)
        state[name.replace("w13", "w1")], state[name.replace("w13", "w3")] = gate.clone(), up.clone()
    return state


def load_weights(path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(model config, state dict on CPU, manifest) of a checkpoint; checksums are verified."""
    folder = resolve_checkpoint(path)
    manifest = read_manifest(folder)
    cfg = model_config_from_dict(manifest["model_config"], str(folder / MANIFEST_FILE))
    if manifest.get("layout") == "sharded":
        verify(folder, manifest)
        check_sharded_pickles(folder, manifest)
        return cfg, upgrade_layout(load_sharded_weights(folder), manifest), manifest
    return cfg, upgrade_layout(load_single_file_state(folder, manifest), manifest), manifest
