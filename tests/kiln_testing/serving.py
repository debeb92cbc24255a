"""A live `kiln serve` app on a free port, for the tests that need a real socket (uvicorn, httpx)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx


@contextmanager
def serving(app):
    """`kiln serve`'s app under uvicorn in a thread; yields (base URL, port)."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # as vLLM's test harness does: poll /health until the server answers
        try:
            if httpx.get(base + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield base, port
    finally:
        server.should_exit = True
        thread.join(30)
