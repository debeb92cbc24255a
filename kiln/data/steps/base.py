"""What a curation step is: a small dataclass with one method, reporting its own stats.

A pipeline is a list of steps over documents (`{"id", "text", "source", "meta"}`):

- a `Mapper` rewrites a document (`apply`), e.g. Unicode normalisation;
- a `Filter` keeps or drops one (`reason` returns None to keep, or why it drops); a filter may also
  edit the text in place while deciding (PII scrubbing, line removal);
- a `Deduplicator` needs the whole dataset: every task first `index`es its documents into files, one
  `resolve` decides across all of them, then every task `load`s the decision and filters like a Filter.

The step's dataclass fields are its config: `[data.gopher_quality] min_doc_words = 50` in a recipe
sets `GopherQuality.min_doc_words`. The framework (kiln.data.executor) counts documents and bytes in
and out, drop reasons and seconds per step, and writes every dropped document with its step and
reason to rejected/, so no step drops anything silently.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterable

from kiln.config import build
from kiln.errors import ConfigError, did_you_mean

STEPS: dict[str, type["Step"]] = {}


def register(cls: type["Step"]) -> type["Step"]:
    """Make a step usable by its `name` in recipes (`[data] steps = [...]`)."""
    if not getattr(cls, "name", None):
        raise TypeError(f"{cls.__name__} needs a class attribute `name`")
    if cls.name in STEPS and STEPS[cls.name] is not cls:
        raise TypeError(f"two steps are named {cls.name!r}: {STEPS[cls.name].__name__} and {cls.__name__}")
    STEPS[cls.name] = cls
    return cls


@dataclass
class StepStats:
    """What one step did in one task; tasks' stats add up with `merge`."""

    name: str
    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    reasons: Counter = field(default_factory=Counter)
    counters: Counter = field(default_factory=Counter)

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] += n

    def merge(self, other: "StepStats") -> None:
        for key in ("docs_in", "docs_out", "bytes_in", "bytes_out", "seconds"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.reasons.update(other.reasons)
        self.counters.update(other.counters)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "docs_in": self.docs_in,
            "docs_out": self.docs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "seconds": round(self.seconds, 3),
            "reasons": dict(self.reasons),
            "counters": dict(self.counters),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "StepStats":
        return cls(
            d["name"],
            d["docs_in"],
            d["docs_out"],
            d["bytes_in"],
            d["bytes_out"],
            d["seconds"],
            Counter(d["reasons"]),
            Counter(d["counters"]),
        )


@dataclass
class Step:
    name: ClassVar[str] = ""
    # Apply the step only to documents of these sources; the others pass it untouched. Prose filters
    # tuned on web text would reject most source code, so a mixed corpus filters each domain with
    # the rules made for it. Empty: every document.
    only_sources: list[str] = field(default_factory=list, kw_only=True)

    def __post_init__(self) -> None:
        self.stats = StepStats(self.name)

    def validate(self) -> None:
        """Raise ConfigError(field, message) for impossible values."""

    def setup(self) -> None:
        """Load heavy resources once per worker, before the first document."""


class Mapper(Step):
    def apply(self, doc: dict) -> dict:
        raise NotImplementedError


class Filter(Step):
    def reason(self, doc: dict) -> str | None:
        raise NotImplementedError


class Deduplicator(Filter):
    def index(self, docs: Iterable[dict], workdir: Path, task: int) -> None:
        raise NotImplementedError

    def resolve(self, workdir: Path, n_tasks: int) -> dict:
        raise NotImplementedError

    def load(self, workdir: Path, task: int) -> None:
        raise NotImplementedError


def build_step(name: str, params: dict, key: str) -> Step:
    """A configured step from its name and recipe table; errors name `key.<field>`. The built-in
    steps are registered by importing kiln.data.steps, which re-exports this function."""
    if name not in STEPS:
        raise ConfigError(key, f"unknown step {name!r}{did_you_mean(name, STEPS)}; known: {', '.join(sorted(STEPS))}")
    step = build(STEPS[name], params, key)
    try:
        step.validate()
    except ConfigError as err:
        raise err.within(key) from None
    return step


def step_params(step: Step) -> dict:
    return {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
