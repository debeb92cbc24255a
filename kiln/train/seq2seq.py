"""Pretraining an encoder-decoder (T5) on the same Trainer: the pack's windows through span
corruption (kiln.data.span) and the seq2seq loss. What `kiln pretrain` runs when [model] arch = "t5"."""

from __future__ import annotations

from pathlib import Path

from kiln.data.loader import TokenLoader
from kiln.data.span import SpanCorruptionSource, sentinel_ids, span_layout
from kiln.data.tokenizer import Tokenizer
from kiln.errors import ConfigError
from kiln.model.t5_config import T5Config
from kiln.train.config import TrainConfig
from kiln.train.objective import seq2seq_loss


def span_corruption_data(
    pack_dir, tokenizer_path, train_cfg: TrainConfig, model_cfg: T5Config, world_size: int = 1
) -> tuple[SpanCorruptionSource, SpanCorruptionSource]:
    """(train, val) span-corruption sources over the pack, with the tokenizer's sentinels and the
    model's eos and start (pad) ids. One process: the sources are not split over ranks yet."""
    if world_size > 1:
        raise ConfigError("parallel", f"T5 pretraining runs on one process, got {world_size} ranks")
    if train_cfg.activation_checkpointing != "none":
        raise ConfigError("train.activation_checkpointing", "is not supported for T5 models")
    layout = span_layout(train_cfg.seq_len)
    if max(layout.input_length, layout.target_length) > model_cfg.max_seq_len:
        raise ConfigError("model.max_seq_len", f"{model_cfg.max_seq_len} is shorter than the span-corrupted inputs")
    sentinels = sentinel_ids(Tokenizer.load(Path(tokenizer_path)), layout.spans)

    def source(split: str) -> SpanCorruptionSource:
        loader = TokenLoader(
            pack_dir, split=split, seq_len=train_cfg.seq_len, batch_size=train_cfg.micro_batch_size, seed=train_cfg.seed
        )
        return SpanCorruptionSource(loader, sentinels, model_cfg.eos_id, model_cfg.pad_id, train_cfg.seed)

    return source("train"), source("val")


def t5_trainer_kwargs(pack_dir, tokenizer_path, train_cfg: TrainConfig, model_cfg: T5Config, world_size: int = 1):
    """The Trainer arguments that make it pretrain a T5: its data sources and its loss."""
    data = span_corruption_data(pack_dir, tokenizer_path, train_cfg, model_cfg, world_size)
    return {"data": data, "loss_fn": seq2seq_loss}
