"""Configs of generating text: the sampling parameters (SamplingParams), which every generator takes,
and the recipe's [sample] table (SampleConfig), which adds what to sample.

How a model is loaded and run (device, dtype, quantisation) is a different concern:
kiln.infer.load.InferenceOptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kiln.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the model's logits (kiln.infer.sampling applies them, in
    transformers' order: repetition penalty, temperature, top-k, top-p, min-p). Frozen, so equal
    parameters hash alike: a server samples the rows that share them in one call."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off

    def __post_init__(self):
        # As vLLM: below 1e-5 sampling is greedy, and dividing float32 logits by it overflows to NaN.
        if 0 < self.temperature < 1e-5:
            object.__setattr__(self, "temperature", 0.0)

    def validate(self) -> None:
        # Each check is `not (in range)`, so NaN, for which every comparison is false, fails it: the
        # engine and `kiln generate` build these from Python numbers, not through the recipe's check.
        if not 0 <= self.temperature < math.inf:
            raise ConfigError("temperature", f"must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError("top_k", f"must be >= 0 (0 is off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ConfigError(
                "repetition_penalty", f"must be a positive finite number (1 is off), got {self.repetition_penalty}"
            )


@dataclass(frozen=True)
class SampleConfig(SamplingParams):
    """The recipe's [sample] table: num_samples completions of prompt after a pretraining run. Its
    sampling keys are SamplingParams's (with livelier defaults than SamplingParams's neutral ones)."""

    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    prompt: str = "def "
    max_new_tokens: int = 96
    num_samples: int = 2
    seed: int = 0  # sample i draws from a generator seeded with seed + i

    @property
    def sampling(self) -> SamplingParams:
        """The sampling parameters alone, as the engine takes them."""
        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(SamplingParams)})

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise ConfigError("max_new_tokens", f"must be positive, got {self.max_new_tokens}")
        super().validate()
        if self.num_samples <= 0:
            raise ConfigError("num_samples", f"must be positive, got {self.num_samples}")
