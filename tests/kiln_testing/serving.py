"""A live `kiln serve` app on a free port, for the tests that need a real socket (uvicorn, httpx),
and the tiny random checkpoint the serving tests load."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from kiln.checkpoint import save_weights
from kiln.model import ModelConfig, build_model
from kiln_testing.tokenizer import train_tiny_tokenizer


def tiny_checkpoint(root: Path, folder: Path, max_seq_len: int = 128) -> Path:
    """A saved random checkpoint in folder with its tokenizer.json beside it, as `kiln serve` finds them."""
    # Not the shared kiln_tokenizer (vocab 700): with that vocabulary this random model greedily
    # emits <|pad|>, which the server leaves out of its text and Engine's text keeps.
    tok = train_tiny_tokenizer(root / "tok", vocab_size=600)
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=max_seq_len, init_std=0.2
    )
    save_weights(folder, cfg, build_model(cfg).state_dict(), {"step": 0})
    shutil.copy(tok.path, folder / "tokenizer.json")
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(base: str, timeout_s: float, process=None) -> None:
    """Poll GET /health until the server answers 200, as vLLM's test harness does; a server process
    that exits meanwhile fails with what it printed (process.stdout, else stderr)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise AssertionError((process.stdout or process.stderr).read())
        try:
            if httpx.get(base + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)


@contextmanager
def serving(app):
    """`kiln serve`'s app under uvicorn in a thread; yields (base URL, port)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(base, 60)
    try:
        yield base, port
    finally:
        server.should_exit = True
        thread.join(30)
