"""The setup side of the training loop: the device and parallel layout, the data sources, the
model's size checks against the data, and the checkpoint folder. A mixin of
kiln.train.trainer.Trainer, whose __init__ calls these methods in order."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Callable

import torch

from kiln.checkpoint import ShardedSaver, checkpoint_manager
from kiln.data.loader import TokenLoader
from kiln.data.replay import ReplayLoader, check_same_tokenizer
from kiln.errors import ConfigError, DataError
from kiln.model import ModelConfig
from kiln.model.weights import upgrade_layout
from kiln.parallel.config import ParallelConfig
from kiln.parallel.layout import Layout
from kiln.storage import is_remote
from kiln.train.precision import check_fp8_device, resolve_precision


def training_device(choice: str) -> torch.device:
    """train.device as a torch device: auto is CUDA when torch sees a GPU (under torchrun "cuda" is
    the rank's own, set by init_distributed), else the CPU; a CUDA device torch cannot see is refused."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                "train.device", f"{choice!r} but torch sees no CUDA device (torch {torch.__version__}); use cpu or auto"
            )
        index = torch.device(choice).index
        if index is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                "train.device", f"{choice!r} under torchrun: each rank uses its own GPU; use cuda or auto"
            )
        if index is not None and index >= torch.cuda.device_count():
            raise ConfigError("train.device", f"{choice!r} but torch sees {torch.cuda.device_count()} CUDA devices")
    return torch.device(choice)


class Setup:
    def _place(self, device: str | None, parallel: ParallelConfig | None, model_cfg: ModelConfig, arch: str) -> None:
        """The device, thread count, parallel layout and resolved precision, and the refusals that
        the layout decides."""
        cfg = self.cfg
        self.device = torch.device(device) if device else training_device(cfg.device)
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        self.layout = Layout(parallel, model_cfg, self.device)
        # "auto" becomes the precision this device computes fastest in; from here on cfg holds it.
        precision, note = resolve_precision(cfg.precision, self.device)
        if note and self.layout.rank == 0:
            print(note, file=sys.stderr)
        if precision != cfg.precision:
            cfg = self.cfg = dataclasses.replace(cfg, precision=precision)
        if arch != "decoder" and (self.layout.world_size > 1 or self.layout.one_rank_fsdp):
            # The parallel layouts (kiln.parallel) split the decoder's modules.
            raise ConfigError(
                "parallel", f"model.arch = {arch!r} trains on one process; parallel layouts are decoder-only"
            )
        if cfg.loss_chunk_tokens and self.layout.mesh is not None:
            # Under a mesh the head is wrapped or sharded (DDP, FSDP, a vocabulary-parallel head
            # with loss_parallel, a pipeline's last stage); the chunked head reads its weight directly.
            raise ConfigError(
                "train.loss_chunk_tokens", "runs on one process without parallel layouts; set it to 0 under parallel.*"
            )
        self.rank, self.world_size = self.layout.rank, self.layout.world_size
        self.is_main = self.rank == 0
        if cfg.optimizer_offload == "nvme" and self.layout.sharded:
            raise ConfigError(
                "optimizer_offload",
                "nvme streams the state of whole (unsharded) parameters; with FSDP or tensor "
                "parallelism use parallel.offload (CPU offload) instead",
            )

    def _open_data(self, data: tuple | None, wrap_data: Callable[[object], object] | None) -> None:
        """self.train_loader and self.val_loader: the stage's own sources, or the pack's."""
        if data is not None and self.cfg.replay.pack:
            raise ConfigError("train.replay.pack", "replays a pretraining pack; this stage brings its own data")
        self.replay_val_loader = None  # the replay pack's validation split (train.replay.pack)
        self.train_loader, self.val_loader = data if data is not None else self._pack_loaders()
        if wrap_data is not None:
            self.train_loader, self.val_loader = wrap_data(self.train_loader), wrap_data(self.val_loader)

    def _sized_model_cfg(self, model_cfg: ModelConfig) -> ModelConfig:
        """model_cfg with vocab_size 0 filled in from the data, checked against the data and seq_len."""
        if model_cfg.vocab_size == 0:
            model_cfg = dataclasses.replace(model_cfg, vocab_size=self.train_loader.vocab_size)
        if model_cfg.vocab_size < self.train_loader.vocab_size:
            raise ConfigError(
                "vocab_size",
                f"model has {model_cfg.vocab_size} token ids but the pack "
                f"{self.pack_dir} uses {self.train_loader.vocab_size}",
            )
        if self.cfg.seq_len > model_cfg.max_seq_len:
            raise ConfigError("seq_len", f"{self.cfg.seq_len} exceeds the model's max_seq_len={model_cfg.max_seq_len}")
        return model_cfg

    def _open_checkpoints(self) -> None:
        """self.ckpt (this run's checkpoint folder) and, under a sharded layout, its DCP saver."""
        cfg = self.cfg
        self.ckpt = checkpoint_manager(
            cfg.checkpoint_dir or self.out_dir / "checkpoints",
            cfg.keep_last,
            cfg.keep_best,
            convert_state=upgrade_layout,
            background=self.layout.cfg.async_checkpoint and not self.layout.sharded,
        )
        self.sharded_saver = None
        if self.layout.sharded and is_remote(cfg.checkpoint_dir):
            raise ConfigError(
                "train.checkpoint_dir",
                f"{cfg.checkpoint_dir}: sharded checkpoints (this layout) are written to local disk only",
            )
        if self.layout.sharded:
            self.sharded_saver = ShardedSaver(self.ckpt, self.layout.cfg.async_checkpoint)

    def _check_fp8_layout(self) -> None:
        """fp8's refusals that the device and the layout decide, before anything is built."""
        check_fp8_device(self.device)
        if self.layout.dims.tp > 1:
            # Kiln's tensor-parallel plan shards nn.Linear weights; Float8Linear would need torchao's
            # float8 TP styles in its place, which Kiln does not apply.
            raise ConfigError("parallel.tp", 'tensor parallelism is not combined with precision = "fp8"; use tp = 1')

    def _batch_geometry(self) -> None:
        """Micro-batches per optimizer step (accum_steps) and at the start of the batch ramp.

        Gradient accumulation keeps the tokens per optimizer step at global_batch_tokens whatever
        the micro batch and rank count, so the same recipe trains the same way on 1 or 64 devices.
        Only data-parallel ranks read different data; TP/CP/PP ranks of one replica share a batch."""
        cfg = self.cfg
        tokens_per_micro_step = cfg.seq_len * cfg.micro_batch_size * self.layout.dp_size

        def micro_steps(key: str, tokens: int) -> int:
            if tokens % tokens_per_micro_step:
                raise ConfigError(
                    key,
                    f"must be a multiple of seq_len*micro_batch_size*dp ranks={tokens_per_micro_step}, got {tokens}",
                )
            return tokens // tokens_per_micro_step

        self.accum_steps = micro_steps("global_batch_tokens", cfg.global_batch_tokens)
        self.tokens_per_micro_step = tokens_per_micro_step
        self.ramp_start_accum = self.accum_steps
        if cfg.batch_ramp_steps > 0:
            self.ramp_start_accum = micro_steps("batch_ramp_start_tokens", cfg.batch_ramp_start_tokens)

    def _pack_loaders(self) -> tuple[TokenLoader, TokenLoader]:
        """The pack's (train, val) loaders. A post-training stage brings its own sources instead,
        with the same interface: iteration, state_dict/load_state_dict, validation_batches, vocab_size,
        bytes_per_token. The validation set is fixed: validation_batches(limit, row_multiple)
        yields the same batches every time (see TokenLoader.validation_batches)."""
        cfg = self.cfg

        def make_loader(split: str, pack_dir: Path = self.pack_dir):
            return TokenLoader(
                pack_dir,
                split=split,
                seq_len=cfg.seq_len,
                batch_size=cfg.micro_batch_size,
                rank=self.layout.dp_rank,
                world_size=self.layout.dp_size,
                seed=cfg.seed,
            )

        train, val = make_loader("train"), make_loader("val")
        if cfg.replay.pack:
            train = self._replay_loaders(train, make_loader)
        return train, val

    def _replay_loaders(self, train: TokenLoader, make_loader) -> TokenLoader | ReplayLoader:
        """The train stream mixed with train.replay.pack's (fraction > 0), and that pack's val split
        as self.replay_val_loader; every way the pack can be wrong is one error naming the key."""
        replay = self.cfg.replay
        path = Path(replay.pack)
        if not path.is_dir():
            raise ConfigError("train.replay.pack", f"{path}: no such folder (the earlier run's pack stage folder)")
        try:
            self.replay_val_loader = make_loader("val", path)
            check_same_tokenizer(train, self.replay_val_loader)
            if replay.fraction == 0:  # its split is evaluated, nothing is replayed
                return train
            return ReplayLoader(train, make_loader("train", path), replay.fraction)
        except DataError as err:
            raise ConfigError("train.replay.pack", str(err)) from None
