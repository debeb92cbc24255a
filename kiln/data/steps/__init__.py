"""Curation steps. Importing this package registers every built-in step by name."""

from kiln.data.steps import classifier, decontam, dedup, domain, langid, normalize, pii, quality, toxicity, url  # noqa: F401
from kiln.data.steps.base import STEPS, Deduplicator, Filter, Mapper, Step, build_step, register

__all__ = ["STEPS", "Step", "Mapper", "Filter", "Deduplicator", "register", "build_step"]
