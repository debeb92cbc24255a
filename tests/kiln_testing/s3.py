"""A real S3-compatible server for the tests: moto in server mode on 127.0.0.1, a free port."""

from __future__ import annotations

import logging
import socket
import uuid

import pytest

from kiln import storage

KEYS = {"key": "kiln-test", "secret": "kiln-test-secret"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server():
    """(server, endpoint URL); the caller stops the server."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed (the test extra)")
    pytest.importorskip("s3fs", reason="s3fs is not installed (the s3 extra)")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


def s3_options(endpoint: str) -> dict:
    return {"s3": {"endpoint_url": endpoint, **KEYS, "client_kwargs": {"region_name": "eu-west-1"}}}


def new_bucket(endpoint: str) -> str:
    """A fresh bucket on the server, as its s3:// URL."""
    name = f"kiln-{uuid.uuid4().hex[:12]}"
    storage.filesystem(f"s3://{name}").mkdir(name)
    return f"s3://{name}"
