"""Kiln: train large language models end to end, from raw text to a served model."""

__version__ = "0.1.0"
