"""Config of sampling from a trained model."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError


@dataclass
class SampleConfig:
    prompt: str = "def "
    max_new_tokens: int = 96
    temperature: float = 0.8  # 0: greedy
    top_k: int = 50  # 0: off
    top_p: float = 0.95  # 1.0: off
    num_samples: int = 2
    seed: int = 0

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise ConfigError("max_new_tokens", f"must be positive, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.num_samples <= 0:
            raise ConfigError("num_samples", f"must be positive, got {self.num_samples}")
