"""Fine-tuning a BERT encoder as a sequence classifier (Devlin et al. 2019, sec. 4.1): the pooler
and a linear classifier on the first token's state, trained with the encoder on labelled rows.

The encoder comes from a Kiln BERT checkpoint (masked-LM pretraining, or one `kiln import hf`
made); its head is left behind and the classifier starts fresh (kiln.model.bert.load_encoder). Rows
are kiln.data.mlm.classification_rows (tokens, attention mask, label); they run through the shared
Trainer with kiln.train.objective.classification_loss, so checkpoints, resume, the guard and the
metrics log are the pretraining loop's. Reached from Python (docs/bert.md):

    trainer = finetune_classifier(ckpt, train_rows, val_rows, num_labels=2, train_cfg=cfg, out_dir=out)
    trainer.fit(); accuracy(trainer.model, val_rows)
"""

from __future__ import annotations

import dataclasses

import torch

from kiln.errors import ConfigError
from kiln.model.bert import load_encoder
from kiln.model.config import arch_of
from kiln.model.weights import load_weights
from kiln.post.sources import ExampleSource
from kiln.train.config import TrainConfig
from kiln.train.objective import classification_loss
from kiln.train.trainer import Trainer


def finetune_classifier(
    init, train_rows: list, val_rows: list, num_labels: int, train_cfg: TrainConfig, out_dir, device: str | None = None
) -> Trainer:
    """A Trainer (call .fit()) of a classifier with num_labels classes on the encoder of the BERT
    checkpoint `init`. A Trainer resumes from out_dir's checkpoints as any stage does."""
    cfg, state, _ = load_weights(init)
    if arch_of(cfg) != "bert":
        raise ConfigError(
            "init_from", f"{init}: a {arch_of(cfg)!r} checkpoint; classification fine-tuning needs a BERT"
        )
    if num_labels < 2:
        raise ConfigError("num_labels", f"a classifier needs at least 2 classes, got {num_labels}")
    cfg = dataclasses.replace(cfg, num_labels=num_labels)
    sources = (
        ExampleSource(train_rows, train_cfg.micro_batch_size, seed=train_cfg.seed, vocab_size=cfg.vocab_size),
        ExampleSource(val_rows, train_cfg.micro_batch_size, shuffle=False, vocab_size=cfg.vocab_size),
    )
    return Trainer(
        cfg,
        train_cfg,
        None,
        out_dir,
        loss_fn=classification_loss,
        data=sources,
        device=device,
        prepare_model=lambda model: load_encoder(model, state, init),
    )


@torch.no_grad()
def accuracy(model: torch.nn.Module, rows: list, batch_size: int = 64) -> float:
    """Share of rows whose highest-scoring class is their label."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    right = 0
    for start in range(0, len(rows), batch_size):
        tokens, mask, labels = (torch.stack(parts).to(device) for parts in zip(*rows[start : start + batch_size]))
        right += int((model(tokens, mask).argmax(-1) == labels).sum())
    model.train(was_training)
    return right / max(len(rows), 1)
