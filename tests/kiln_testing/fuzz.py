"""What the property tests share: the example budget, Hypothesis settings that give the same
examples on every run, and an alarm that turns an endless loop into a failure."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

HANG_S = 30  # far above any single call the fuzz tests make; only an endless loop reaches it


class Hang(Exception):
    pass


@contextmanager
def no_hang(seconds: int = HANG_S):
    """Fail the example if it runs for `seconds` (a real hang, not a slow machine). SIGALRM: the
    main thread only, not on Windows."""

    def fire(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def fuzz_examples(default: int) -> int:
    """Examples per property: KILN_FUZZ_EXAMPLES when set, else the module's modest default."""
    return int(os.environ.get("KILN_FUZZ_EXAMPLES", str(default)))


def fuzz_settings(max_examples: int, suppress=()):
    """Hypothesis settings with no deadline, no example database and derandomised generation, so
    every run (and every machine) tries the same examples; `suppress` lists HealthChecks to skip."""
    from hypothesis import settings

    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(suppress),
    )
