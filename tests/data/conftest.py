"""Shared fixtures of the data tests."""

import pytest
from kiln_testing.text import stdlib_chunks as _stdlib_chunks


@pytest.fixture(scope="session")
def stdlib_chunks():
    """stdlib_chunks(n, words=300, reverse=False) -> list of real-text documents."""
    return _stdlib_chunks
