"""The Transformer, its config and presets.

The model itself (and so torch) is imported on first use: recipes import ModelConfig, and a data-only
command should not pay for importing torch.
"""

from kiln.model.config import PRESETS, ModelConfig, RopeScaling, preset

_MODEL_NAMES = ("Transformer", "build_model", "count_params", "flops_per_token")


def __getattr__(name: str):
    if name in _MODEL_NAMES:
        # Building and counting go through the family dispatch: they take a config of any arch.
        from kiln.model import families, transformer  # torch: on first use, not when a recipe is parsed

        return getattr(families if hasattr(families, name) else transformer, name)
    raise AttributeError(f"module 'kiln.model' has no attribute {name!r}")


__all__ = ["ModelConfig", "PRESETS", "RopeScaling", "preset", *_MODEL_NAMES]
