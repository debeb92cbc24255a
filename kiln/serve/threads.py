"""Where the server's torch work runs: one OpenMP pool per process, held by the scheduler thread."""

from __future__ import annotations

import threading


def on_passing_thread(fn, *args):
    """fn(*args) on a thread that ends before this returns: its value, or its exception re-raised.

    Why: torch's OpenMP runtime (libgomp) keeps a pool of worker threads for every thread that ran a
    parallel op, and once it manages more threads than there are CPUs it stops spin-waiting between
    parallel regions and sleeps on futexes instead. Loading on the main thread left a second pool
    beside the scheduler thread's, and every one of the decode step's many small ops paid a wake-up:
    steps 1.3-2x slower on a 2-core machine (docs/benchmarks.md). A pool goes away with its thread, so load,
    cast and prepack the model in fn, and the scheduler thread holds the only pool: `kiln serve` does,
    and so should a Python caller of kiln.serve.app.create_app (docs/serve.md, "From Python")."""
    outcome = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - re-raised on the calling thread below
            outcome["error"] = err

    thread = threading.Thread(target=run, name="kiln-load")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
