"""Shared by the server tests: a model wrapper that forces a token, and a live server on a free port."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import torch


class ForcesToken(torch.nn.Module):
    """The model, but `token` is forced as the prediction at position `at` (and, with `onward`, at
    every later position too, so a request that stops on that token stops there)."""

    def __init__(self, inner, token: int, at: int, onward: bool = True):
        super().__init__()
        self.inner, self.cfg, self.token, self.at, self.onward = inner, inner.cfg, token, at, onward

    def forward(self, tokens, kv_cache=None, **kwargs):
        before = torch.tensor(kv_cache.lengths if kv_cache is not None else [0] * tokens.shape[0])
        logits = self.inner(tokens, kv_cache=kv_cache, **kwargs)
        predicted = before[:, None] + torch.arange(tokens.shape[1]) + 1  # position each logit predicts
        hit = predicted >= self.at if self.onward else predicted == self.at
        logits[..., self.token] += hit.to(logits.dtype) * 1000.0
        return logits


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
