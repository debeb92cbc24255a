"""Which model family a config describes: the one dispatch on `[model] arch`. Torch-free, so a
recipe or a checkpoint manifest picks its config class without importing a model."""

from __future__ import annotations

import dataclasses

from kiln.errors import ConfigError
from kiln.model.config import ModelConfig
from kiln.model.t5_config import T5Config

CONFIGS: dict[str, type] = {"decoder": ModelConfig, "t5": T5Config}


def config_class(arch) -> type:
    """The config dataclass of `arch`; ConfigError("arch") naming the known ones otherwise."""
    if arch not in CONFIGS:
        raise ConfigError("arch", f"unknown model family {arch!r}; known: {', '.join(CONFIGS)}")
    return CONFIGS[arch]


def config_from_dict(d: dict) -> object:
    """A manifest's model config (a plain dict) as its family's dataclass. Raises KeyError(list of
    the keys the family does not have) and ConfigError("arch") for a family Kiln does not know."""
    cls = config_class(d.get("arch", "decoder"))  # checkpoints from before `arch` existed are decoders
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise KeyError(unknown)
    return cls(**d)
