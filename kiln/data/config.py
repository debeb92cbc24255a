"""Configs of the data stages: corpus building, tokenizer training and packing."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from kiln.data.steps import build_step
from kiln.data.warc import DEFAULT_EXTRACTOR, check_extractor
from kiln.errors import ConfigError

BUILTIN_SOURCES = ("python_stdlib", "python_docs", "debian_docs")


@dataclass
class CorpusConfig:
    sources: list[str] = field(default_factory=lambda: list(BUILTIN_SOURCES))
    max_bytes_per_source: int = 6_000_000  # keeps the CPU demo within its time budget
    min_chars: int = 64  # shorter documents carry almost no signal
    max_chars: int = 32_000  # longer files are split at line boundaries
    seed: int = 0

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("sources", "must name at least one source")
        for name in self.sources:
            if name not in BUILTIN_SOURCES:
                raise ConfigError("sources", f"unknown source {name!r}; known: {', '.join(BUILTIN_SOURCES)}")
        if self.max_bytes_per_source <= 0:
            raise ConfigError("max_bytes_per_source", f"must be positive, got {self.max_bytes_per_source}")
        if not 0 < self.min_chars < self.max_chars:
            raise ConfigError("min_chars", f"must satisfy 0 < min_chars < max_chars={self.max_chars}")


@dataclass
class TokenizerConfig:
    vocab_size: int = 8192
    min_frequency: int = 2
    heldout_fraction: float = 0.02  # documents kept out of training to measure bytes per token
    max_train_bytes: int = 0  # 0: train on the whole corpus
    sentinels: int = 0  # <|sentinel_k|> tokens after the fixed special ones, for T5 span corruption

    def validate(self) -> None:
        # 256 byte symbols plus the reserved special tokens must fit before any merge.
        if self.vocab_size < 512:
            raise ConfigError("vocab_size", f"must be at least 512, got {self.vocab_size}")
        if not 0 <= self.sentinels <= self.vocab_size - 512:
            raise ConfigError(
                "sentinels", f"must be in 0..vocab_size - 512 = {self.vocab_size - 512}, got {self.sentinels}"
            )
        if self.min_frequency < 1:
            raise ConfigError("min_frequency", f"must be >= 1, got {self.min_frequency}")
        if not 0 < self.heldout_fraction < 0.5:
            raise ConfigError("heldout_fraction", f"must be in (0, 0.5), got {self.heldout_fraction}")


@dataclass
class PackConfig:
    val_fraction: float = 0.01  # documents (by stable hash of id) held out for validation
    mixture: dict[str, float] = field(default_factory=dict)  # source -> weight; empty: by token count
    shard_tokens: int = 16_777_216  # tokens per shard file

    def validate(self) -> None:
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError("val_fraction", f"must be in (0, 0.5), got {self.val_fraction}")
        for name, weight in self.mixture.items():
            if weight < 0:
                raise ConfigError(f"mixture.{name}", f"must be >= 0, got {weight}")
        if self.mixture and sum(self.mixture.values()) <= 0:
            raise ConfigError("mixture", "weights must not all be zero")
        if self.shard_tokens <= 0:
            raise ConfigError("shard_tokens", f"must be positive, got {self.shard_tokens}")


# The default chain: cheap normalisation and language ID first, then the heuristic filters, then
# deduplication (exact before fuzzy, so MinHash sees fewer documents), PII scrubbing last so that
# dedup compares the original text.
DEFAULT_STEPS = [
    "normalize",
    "langid",
    "gopher_quality",
    "gopher_repetition",
    "fineweb",
    "exact_dedup",
    "minhash_dedup",
    "pii",
]


EXECUTORS = ("local", "ray")


@dataclass
class CurateConfig:
    inputs: list[str] = field(default_factory=list)  # files, folders or globs; empty: the run's corpus
    steps: list[str] = field(default_factory=lambda: list(DEFAULT_STEPS))
    params: dict = field(default_factory=dict)  # [data.params.<step>] tables: each step's fields
    tasks: int = 4  # shards of work; the unit of resumption
    workers: int = 2  # processes running tasks in parallel (local executor)
    executor: str = "local"  # "local" (worker processes) or "ray" (pip install 'kiln[ray]')
    ray_address: str = ""  # "": start Ray here; "auto", "host:6379", "ray://host:10001": join
    html_extractor: str = DEFAULT_EXTRACTOR  # main text of WARC inputs' HTML: "resiliparse" or "trafilatura"

    def validate(self) -> None:
        if self.tasks <= 0:
            raise ConfigError("tasks", f"must be positive, got {self.tasks}")
        if self.workers <= 0:
            raise ConfigError("workers", f"must be positive, got {self.workers}")
        if self.executor not in EXECUTORS:
            raise ConfigError("executor", f"must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.executor == "ray" and importlib.util.find_spec("ray") is None:
            # Fail at recipe load, not after the stages before `data` have run.
            raise ConfigError("executor", "\"ray\" needs Ray installed: pip install 'kiln[ray]'")
        check_extractor(self.html_extractor, installed=False)  # installed: checked once WARC inputs are listed
        for name in self.params:
            if name not in self.steps:
                raise ConfigError(f"params.{name}", f"configures a step that is not in steps {self.steps}")
        self.build_steps()

    def build_steps(self) -> list:
        return [build_step(name, self.params.get(name, {}), f"params.{name}") for name in self.steps]
