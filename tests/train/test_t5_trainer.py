"""A T5 on the shared Trainer: span-corruption batches of a tiny pack and the seq2seq loss; the loss
falls, the checkpoint is a T5 one, and a resumed run continues the same noise stream."""

import json

import numpy as np
import pytest
import torch
from kiln_testing.train import tiny_train_config

from kiln.data.config import TokenizerConfig
from kiln.data.loader import TokenLoader
from kiln.data.span import SpanCorruptionSource
from kiln.data.tokenizer import train_tokenizer
from kiln.errors import ConfigError
from kiln.model.t5_config import T5Config
from kiln.peft.load import load_model
from kiln.train.objective import seq2seq_loss
from kiln.train.seq2seq import span_corruption_data
from kiln.train.trainer import Trainer

# The pack's ids are 0..63; 64.. are the sentinels, 1 the decoder start (pad), 0 the eos.
CFG = T5Config(vocab_size=80, dim=32, n_heads=2, head_dim=16, ffn_hidden=64, n_layers=1, rel_buckets=8,
               rel_max_distance=16, max_seq_len=64)  # fmt: skip


def sources(pack, cfg):
    def source(split):
        loader = TokenLoader(pack, split=split, seq_len=cfg.seq_len, batch_size=cfg.micro_batch_size, seed=cfg.seed)
        return SpanCorruptionSource(loader, np.arange(64, 80), eos=CFG.eos_id, start=CFG.pad_id, seed=cfg.seed)

    return source("train"), source("val")


def trainer(pack, out, resume="auto", **overrides):
    cfg = tiny_train_config(seq_len=32, global_batch_tokens=128, **overrides)
    return Trainer(CFG, cfg, pack, out, resume=resume, data=sources(pack, cfg), loss_fn=seq2seq_loss, device="cpu")


def test_t5_trains_on_the_shared_trainer(tmp_path, tiny_pack_factory):
    pack = tiny_pack_factory(tmp_path / "pack")
    summary = trainer(pack, tmp_path / "run", max_steps=12, eval_every=4, lr=1e-2, warmup_steps=2).fit()
    val = [json.loads(line)["val_loss"] for line in (tmp_path / "run" / "metrics.jsonl").open() if '"val"' in line]
    assert len(val) == 3 and all(b < a for a, b in zip(val, val[1:])), val
    assert summary["tokens_seen"] == 12 * 4 * (5 + 2 + 1)  # 32-token windows: 5 noise tokens, 2 spans, eos
    model, manifest = load_model(tmp_path / "run" / "checkpoints")
    assert type(model).__name__ == "T5" and manifest["model_config"]["arch"] == "t5"


def test_resumed_t5_run_equals_an_uninterrupted_one(tmp_path, tiny_pack_factory):
    """Resuming from the step-2 checkpoint of a 4-step run ends at that run's weights: the loader
    position and the span-noise counter come back with the checkpoint."""
    pack = tiny_pack_factory(tmp_path / "pack")
    trainer(pack, tmp_path / "whole", max_steps=4, ckpt_every=2, eval_every=4).fit()
    middle = tmp_path / "whole" / "checkpoints" / "step-00000002"
    resumed = trainer(pack, tmp_path / "resumed", max_steps=4, ckpt_every=2, eval_every=4, resume=str(middle))
    assert resumed.step == 2 and resumed.train_loader.windows == 2 * 4
    resumed.fit()
    whole, _ = load_model(tmp_path / "whole" / "checkpoints")
    again, _ = load_model(tmp_path / "resumed" / "checkpoints")
    for (name, a), b in zip(whole.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_span_corruption_data_accepts_no_checkpointing_and_refuses_the_rest(tmp_path, tiny_pack_factory):
    """`kiln pretrain` of a T5 builds its sources here: the default mode ("none") runs, a real mode is
    refused by key (the T5 blocks have no checkpointing wrapper)."""
    pack = tiny_pack_factory(tmp_path / "pack")
    texts = ["def f(x):\n    return x + 1\n"] * 50
    train_tokenizer(texts, TokenizerConfig(vocab_size=600, sentinels=16), tmp_path / "tok", heldout=texts[:2])
    cfg = tiny_train_config(seq_len=32, global_batch_tokens=128)
    assert cfg.activation_checkpointing == "none"
    train, val = span_corruption_data(pack, tmp_path / "tok" / "tokenizer.json", cfg, CFG)
    assert isinstance(train, SpanCorruptionSource) and isinstance(val, SpanCorruptionSource)
    for mode in ("selective", "full"):
        refused = tiny_train_config(seq_len=32, global_batch_tokens=128, activation_checkpointing=mode)
        with pytest.raises(ConfigError, match="train.activation_checkpointing"):
            span_corruption_data(pack, tmp_path / "tok" / "tokenizer.json", refused, CFG)
