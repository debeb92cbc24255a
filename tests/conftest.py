import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

# Tests compare numbers bit-for-bit in places; pin the thread count so results do not
# depend on how many cores the machine reports.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_tiny_pack(root: Path, vocab: int = 64, train_docs: int = 200, val_docs: int = 40) -> Path:
    """A pack in the contract's layout whose documents follow a fixed successor rule
    (t -> 5t+3 mod vocab), so a model can learn it and the loss must fall."""
    rng = np.random.default_rng(0)
    for split, docs in (("train", train_docs), ("val", val_docs)):
        tokens = []
        for _ in range(docs):
            t = int(rng.integers(1, vocab))
            for _ in range(int(rng.integers(10, 60))):
                tokens.append(t)
                t = (5 * t + 3) % (vocab - 1) + 1
            tokens.append(0)  # end of document
        (root / split).mkdir(parents=True)
        np.asarray(tokens, dtype="<u2").tofile(root / split / "synthetic-00000.bin")
        header = {
            "dtype": "uint16",
            "vocab_size": vocab,
            "tokenizer_sha256": "test",
            "documents": docs,
            "tokens": len(tokens),
            "bytes": 3 * len(tokens),
            "source": "synthetic",
        }
        (root / split / "synthetic-00000.json").write_text(json.dumps(header))
    (root / "mixture.json").write_text(
        json.dumps({"vocab_size": vocab, "tokenizer_sha256": "test", "weights": {"synthetic": 1.0}})
    )
    return root


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
def byte_tokenizer(tmp_path_factory):
    """Byte-level BPE whose only merges are ASCII: a Chinese character is 3 tokens, an emoji 4."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from kiln.data.tokenizer import Tokenizer

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(
        ["hello world. hello there."] * 4,
        trainers.BpeTrainer(
            vocab_size=270,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    hf.save(str(path))
    return Tokenizer.load(path)
