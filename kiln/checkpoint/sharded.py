"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Every rank writes its own shards of the model and optimizer state into `<step>/sharded/`; rank 0
then adds the loop state and the manifest (sha256 of every file, written last) and publishes the
folder with the same atomic rename and `latest`/`best` pointers as single-file checkpoints
(kiln.checkpoint.manager). State dicts are keyed by parameter name, and DCP reshards on load, so a
checkpoint saved by N ranks in one layout resumes on M ranks in another, or in one plain process.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from kiln.checkpoint.format import TRAIN_STATE_FILE, write_manifest
from kiln.checkpoint.manager import CheckpointManager
from kiln.checkpoint.safety import SHARDED_DIR, WeightsOnlyLoadPlanner
from kiln.files import publishing, reporting


def _optimizers(optimizer):
    """What DCP's optimizer state dict takes: a torch optimizer, or the optimizers an object joins
    under `parts` (kiln.train.muon.MuonAdamW), whose states DCP keys by parameter name together."""
    parts = getattr(optimizer, "parts", None)
    return list(parts.values()) if parts is not None else optimizer


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class ShardedSaver:
    """Saves sharded checkpoints; with async_save the shards are written in the background and the
    checkpoint is published (manifest, rename) at the next save or at finish()."""

    def __init__(self, manager: CheckpointManager, async_save: bool = False):
        self.manager = manager
        self.async_save = async_save
        self._pending = None  # (future, tmp folder, step, model_cfg, train_state, manifest_extra, is_best)
        self._cpu_group = None

    def save(
        self, step: int, model_cfg, model, optimizer, train_state: dict, manifest_extra: dict, is_best: bool = False
    ) -> None:
        self.finish()
        tmp = self.manager.root / f".tmp-step-{step:08d}"
        if _rank() == 0:
            tmp = self.manager.begin(step)
        _barrier()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, _optimizers(optimizer))}
        writer = tmp / SHARDED_DIR
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=writer, process_group=self._async_group())
            self._pending = (future, tmp, step, model_cfg, train_state, manifest_extra, is_best)
        else:
            with reporting(writer):
                dcp.save(state, checkpoint_id=writer)
            self._publish(tmp, step, model_cfg, train_state, manifest_extra, is_best)

    def _async_group(self):
        """async_save coordinates the ranks over a CPU backend, which an NCCL job's default group
        lacks; a gloo group over the same ranks serves (made once, by every rank at its first save)."""
        if not dist.is_initialized():
            return None
        if self._cpu_group is None:
            self._cpu_group = dist.new_group(backend="gloo")
        return self._cpu_group

    def finish(self) -> None:
        if self._pending is None:
            return
        future, *rest = self._pending
        self._pending = None
        with reporting(rest[0] / SHARDED_DIR):
            future.result()
        self._publish(*rest)

    def _publish(self, tmp: Path, step: int, model_cfg, train_state: dict, manifest_extra: dict, is_best: bool):
        _barrier()  # every rank's shards are on disk
        if _rank() == 0:
            with publishing(tmp / TRAIN_STATE_FILE) as partial:
                torch.save(train_state, partial)
            names = sorted(str(p.relative_to(tmp)) for p in (tmp / SHARDED_DIR).rglob("*") if p.is_file())
            write_manifest(
                tmp, model_cfg, [*names, TRAIN_STATE_FILE], {"step": step, "layout": "sharded", **manifest_extra}
            )
            self.manager.commit(tmp, step, is_best)
        _barrier()


def load_sharded(folder: Path, model, optimizer) -> None:
    """Load a (verified) sharded checkpoint's model and optimizer state into any layout."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, _optimizers(optimizer))}
    dcp.load(state, checkpoint_id=Path(folder) / SHARDED_DIR, planner=WeightsOnlyLoadPlanner())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, _optimizers(optimizer), state["optim"])


def load_sharded_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a sharded checkpoint, read in this one process (for
    generation, HF export or conversion to a single file); no process group needed."""
    reader = dcp.FileSystemReader(str(Path(folder) / SHARDED_DIR))
    metadata = reader.read_metadata().state_dict_metadata
    state = {}
    for key, meta in metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), no_dist=True)
    return {key[len("model.") :]: t for key, t in state.items()}
