"""A training run small enough for a unit test: a learnable token pack and a TrainConfig for it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


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


def tiny_train_config(**overrides):
    """A TrainConfig for a few CPU steps on make_tiny_pack's data: 4 x 16-token micro-batches, one per
    step, 8 steps (2 warmup) at lr 1e-2 in fp32, logging every step, evaluating (2 batches) and
    checkpointing every 4; `overrides` replace any field."""
    from kiln.train.config import TrainConfig

    base = dict(
        seq_len=16,
        micro_batch_size=4,
        global_batch_tokens=64,
        max_steps=8,
        lr=1e-2,
        warmup_steps=2,
        precision="fp32",
        log_every=1,
        eval_every=4,
        eval_batches=2,
        ckpt_every=4,
        peak_flops=1e12,
    )
    return TrainConfig(**{**base, **overrides})
