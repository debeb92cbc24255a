"""The Transformer, its config and presets."""

from kiln.model.config import PRESETS, ModelConfig, preset
from kiln.model.transformer import Transformer, build_model, count_params, flops_per_token

__all__ = ["ModelConfig", "PRESETS", "preset", "Transformer", "build_model", "count_params", "flops_per_token"]
