"""Rotary position embedding (Su et al. 2021) and its context-extension variants.

Each variant changes only the rotation frequencies (and, for YaRN, scales cos/sin by an attention
factor), so the tables stay [max_seq_len, head_dim] and the attention code is untouched. The
formulas and their sources are in docs/long_context.md; RopeScaling (kiln/model/config.py) holds
the settings. Everything is computed in float64 and rounded once to float32 at the end: the angles
t * inv_freq lose digits in fp32 once t is in the thousands.
"""

from __future__ import annotations

import math

import torch

from kiln.errors import ConfigError
from kiln.model.config import ROPE_KEYS, ROPE_OPTIONAL, ModelConfig, RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None, seq_len: int = 0):
    """(inverse frequencies [head_dim/2] in float64, factor cos/sin are multiplied by). seq_len is
    the length being processed: only the dynamic type depends on it."""
    index = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # 2i/d
    inv_freq = theta ** (-index)
    if scaling is None:
        return inv_freq, 1.0
    factor, original = scaling.factor, scaling.original_max_seq_len
    if scaling.type == "linear":  # Chen et al. 2023: position t is read as t / factor
        return inv_freq / factor, 1.0
    if scaling.type == "dynamic":
        # NTK-aware base change (bloc97), with the scale growing with the processed length: no
        # change up to the original context, `factor` times the base's d/(d-2) power per extra context.
        length = max(seq_len, original)
        base = theta * (factor * length / original - (factor - 1)) ** (head_dim / (head_dim - 2))
        return base ** (-index), 1.0
    if scaling.type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    return _yarn(inv_freq, head_dim, theta, scaling), yarn_attention_factor(scaling)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Wavelengths shorter than original/high_freq_factor keep their frequency, longer than
    # original/low_freq_factor are divided by factor; in between a linear blend in original/wavelength.
    low, high = s.llama3_freq_factors
    wavelen = 2 * math.pi / inv_freq
    smooth = ((s.original_max_seq_len / wavelen - low) / (high - low)).clamp(0, 1)
    return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    beta_fast, beta_slow, truncate = s.yarn_betas + (s.truncate is not False,)

    def dim_of(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return head_dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # ramp 0 (fast dimensions): extrapolate, frequency kept; ramp 1 (slow): interpolate by factor.
    return inv_freq * (1 - ramp) + inv_freq / s.factor * ramp


def yarn_attention_factor(s: RopeScaling) -> float:
    """YaRN's sqrt(1/t) = 0.1 ln(factor) + 1 (Peng et al. 2023, eq. 22), applied to cos and sin so that
    q.k is scaled by its square; DeepSeek's mscale / mscale_all_dim ratio when both are set."""
    if s.attention_factor is not None:
        return s.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    return mscale(s.factor)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, device=None, scaling: RopeScaling | None = None, seq_len: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [max_seq_len, head_dim] for rotate-half RoPE (Su et al. 2021)."""
    inv_freq, attention = inv_frequencies(head_dim, theta, scaling, seq_len)
    positions = torch.arange(max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # dimension i and i + head_dim/2 share an angle
    return (angles.cos() * attention).float().to(device), (angles.sin() * attention).float().to(device)


def rotation(cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor, positions, extent: int):
    """cos, sin at `positions` (a slice or index tensor) of a forward whose largest position is
    extent - 1. The precomputed tables serve every type but dynamic past the original context,
    whose frequencies depend on the length and are rebuilt for it (as transformers does per call)."""
    s = cfg.rope_scaling
    if s is None or s.type != "dynamic" or extent <= s.original_max_seq_len:
        return cos[positions], sin[positions]
    # Only the positions asked for (a decode step: one per row), in float64 on the CPU as the tables.
    inv_freq, _ = inv_frequencies(cfg.head_dim, cfg.rope_theta, s, extent)
    pos = torch.arange(extent)[positions] if isinstance(positions, slice) else positions.cpu()
    angles = pos.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(cos.device), angles.sin().float().to(cos.device)


# transformers' rope_parameters / rope_scaling keys that Kiln's RopeScaling reads under its own name.
HF_ROPE_KEYS = {"factor", "original_max_position_embeddings", *ROPE_OPTIONAL}


def rope_scaling_from_hf(rope: dict, max_position_embeddings: int) -> tuple[RopeScaling | None, int]:
    """(RopeScaling or None, Kiln max_seq_len) for a transformers rope_parameters / rope_scaling dict.
    transformers' dynamic type treats max_position_embeddings as the original context and has no end,
    so Kiln's table is made factor times longer; the other types keep max_position_embeddings."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None, max_position_embeddings
    if kind not in ROPE_KEYS:
        raise ConfigError("rope_type", f"{kind!r} is not supported; Kiln reads default, {', '.join(ROPE_KEYS)}")
    unknown = sorted(set(rope) - HF_ROPE_KEYS - {"rope_type", "type", "rope_theta"})
    if unknown:
        raise ConfigError(f"rope_parameters.{unknown[0]}", f"is not supported with rope_type {kind!r}")
    original = rope.get("original_max_position_embeddings", max_position_embeddings)
    factor = rope.get("factor")
    if factor is None and kind == "yarn":  # transformers derives it so (DeepSeek-V3's configs)
        factor = max_position_embeddings / original
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):
        raise ConfigError("rope_parameters.factor", f"must be a number, got {factor!r}")
    scaling = RopeScaling(type=kind, factor=float(factor))
    max_seq_len = max_position_embeddings
    if kind == "dynamic":
        scaling.original_max_seq_len = max_position_embeddings
        max_seq_len = int(factor * max_position_embeddings)
    elif kind != "linear":
        scaling.original_max_seq_len = original
    for key in ROPE_OPTIONAL:
        value = rope.get(key)
        if value is None:
            continue
        if key not in ROPE_KEYS[kind]:
            raise ConfigError(f"rope_parameters.{key}", f"is not read by rope_type {kind!r}")
        wanted = bool if key == "truncate" else (int, float)
        if not isinstance(value, wanted) or (key != "truncate" and isinstance(value, bool)):
            raise ConfigError(
                f"rope_parameters.{key}",
                f"expected {'true or false' if key == 'truncate' else 'a number'}, got {value!r}",
            )
        setattr(scaling, key, value if key == "truncate" else float(value))
    return scaling, max_seq_len


def rope_scaling_to_hf(cfg: ModelConfig) -> dict:
    """config.json entries for cfg's RoPE: rope_parameters (transformers 5.x) and rope_scaling (4.x,
    vLLM); max_position_embeddings is transformers' dynamic threshold, so that type writes the original."""
    s = cfg.rope_scaling
    if s is None:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    params = s.hf_parameters()
    out = {"rope_scaling": params, "rope_parameters": {**params, "rope_theta": cfg.rope_theta}}
    if s.type == "dynamic":
        out["max_position_embeddings"] = s.original_max_seq_len
    return out
