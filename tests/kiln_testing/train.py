"""A training run small enough for a unit test: a learnable token pack and a TrainConfig for it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def make_tiny_pack(
    root: Path,
    vocab: int = 64,
    train_docs: int = 200,
    val_docs: int = 40,
    rule: tuple[int, int] = (5, 3),
    tokenizer_sha256: str = "test",
) -> Path:
    """A pack in the contract's layout whose documents follow a fixed successor rule
    (t -> a*t+b mod vocab, `rule` = (a, b), default 5t+3), so a model can learn it and the loss must
    fall; two rules make two domains of one vocabulary (continual pretraining). rule=(1, -1) repeats
    one token through each document: its whole context says what a masked token is."""
    a, b = rule
    rng = np.random.default_rng(0)
    for split, docs in (("train", train_docs), ("val", val_docs)):
        tokens = []
        for _ in range(docs):
            t = int(rng.integers(1, vocab))
            for _ in range(int(rng.integers(10, 60))):
                tokens.append(t)
                t = (a * t + b) % (vocab - 1) + 1
            tokens.append(0)  # end of document
        (root / split).mkdir(parents=True)
        np.asarray(tokens, dtype="<u2").tofile(root / split / "synthetic-00000.bin")
        header = {
            "dtype": "uint16",
            "vocab_size": vocab,
            "tokenizer_sha256": tokenizer_sha256,
            "documents": docs,
            "tokens": len(tokens),
            "bytes": 3 * len(tokens),
            "source": "synthetic",
        }
        (root / split / "synthetic-00000.json").write_text(json.dumps(header))
    (root / "mixture.json").write_text(
        json.dumps({"vocab_size": vocab, "tokenizer_sha256": tokenizer_sha256, "weights": {"synthetic": 1.0}})
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


def token_batch(n: int = 4, seq: int = 16, vocab: int = 64, seed: int = 1):
    """(inputs, targets) of n random sequences of seq tokens, the same for the same arguments."""
    import torch

    tokens = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def train_step_capturing_grads(trainer, micro_batches: list) -> tuple[dict, dict]:
    """(stats, gradients) of one trainer.train_step: the gradients as the optimizer sees them, after
    accumulation, loss scaling and clipping."""
    grads = {}
    optimizer_step = trainer.optimizer.step

    def capture_then_step(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = capture_then_step
    try:
        stats = trainer.train_step(micro_batches)
    finally:
        trainer.optimizer.step = optimizer_step
    return stats, grads
