"""Curation steps. Importing this package registers every built-in step by name."""

from kiln.data.steps import (  # noqa: F401
    bias,
    classifier,
    decontam,
    dedup,
    domain,
    langid,
    normalize,
    pii,
    quality,
    toxicity,
    url,
)
from kiln.data.steps.base import STEPS, Deduplicator, Filter, Mapper, Step, build_step, register

__all__ = ["STEPS", "Step", "Mapper", "Filter", "Deduplicator", "register", "build_step"]
