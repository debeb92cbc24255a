"""Fixtures for the whole test tree. The plain functions behind them are in tests/kiln_testing/."""

import os

import pytest
import torch
from kiln_testing.s3 import new_bucket, s3_options, start_server
from kiln_testing.tokenizer import train_byte_bpe, train_tiny_tokenizer
from kiln_testing.train import make_tiny_pack

from kiln import storage

# Tests compare numbers bit-for-bit in places; pin the thread count so results do not
# depend on how many cores the machine reports.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_pack_factory():
    """make_tiny_pack(root) -> root, for tests that need a fresh pack of their own."""
    return make_tiny_pack


@pytest.fixture
def one_thread():
    """Decoding runs many tiny matmuls in sequence; a second thread only adds hand-off stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def kiln_tokenizer(tmp_path_factory):
    """The one Kiln tokenizer of the run: Kiln's own BPE (SPECIAL_TOKENS at ids 0..n-1), vocab_size
    700, trained on stdlib_texts(). Shared by every test, so treat it (and its tokenizer.json at
    .path) as read-only; copy the file to put it beside a checkpoint."""
    return train_tiny_tokenizer(tmp_path_factory.mktemp("kiln_tokenizer"))


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory):
    """Byte-level BPE whose only merges are ASCII: a Chinese character is 3 tokens, an emoji 4.
    vocab_size 270 (below any tiny model's), <|endoftext|> its only special token."""
    from kiln.data.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("byte_tokenizer") / "tokenizer.json"
    train_byte_bpe(path, ["hello world. hello there."] * 4, vocab_size=270)
    return Tokenizer.load(path)


@pytest.fixture(scope="session")
def s3_server():
    """The endpoint URL of a moto S3 server the session started on 127.0.0.1 (skipped without moto)."""
    server, endpoint = start_server()
    yield endpoint
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty s3:// bucket on the test server, with kiln.storage pointed at the server."""
    storage.configure(s3_options(s3_server))
    yield new_bucket(s3_server)
    storage.configure({})
