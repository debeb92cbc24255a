"""The checkpoints root of one run: save, publish atomically, find the newest valid one, rewind,
prune."""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

from kiln.checkpoint.format import (
    MANIFEST_FILE,
    MODEL_FILE,
    TRAIN_STATE_FILE,
    CheckpointError,
    complete_checkpoints,
    fsync,
    read_manifest,
    read_safetensors,
    restore_tied,
    step_dirname,
    verify,
    write_files,
    write_text_atomic,
)
from kiln.checkpoint.safety import check_sharded_pickles
from kiln.storage import join, name_of

DAMAGED_DIR = "damaged"  # where resume moves checkpoints that fail verification

# (model state dict, manifest) -> state dict in the current layout; the model layer supplies it
# (kiln.model.weights.upgrade_layout) because only it knows how its weights were laid out.
StateConverter = Callable[[dict, dict], dict]


class CheckpointManager:
    """Saves, finds, verifies and prunes the step folders of one run's checkpoints root.

    With `background` (parallel.async_checkpoint in a run without sharded checkpoints) `save` copies
    the state and returns; a thread writes, checksums and publishes the folder while training goes
    on. One save is in flight at a time: the next save, `finish` and every load wait for it.
    """

    def __init__(
        self,
        root,
        keep_last: int = 2,
        keep_best: bool = True,
        convert_state: StateConverter | None = None,
        background: bool = False,
    ):
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.convert_state = convert_state
        self.background = background
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None

    def _complete(self) -> list:
        return complete_checkpoints(self.root)

    def holds(self, folder) -> bool:
        """Whether `folder` is one of this root's step folders (resume rewinds only its own root)."""
        return Path(folder).resolve().parent == self.root.resolve()

    def _pointer(self, name: str) -> str | None:
        path = self.root / name
        return path.read_text().strip() if path.is_file() else None

    @property
    def best_name(self) -> str | None:
        return self._pointer("best")

    @property
    def latest_name(self) -> str | None:
        return self._pointer("latest")

    def save(
        self,
        step: int,
        model_cfg,
        model_state: dict,
        train_state: dict,
        manifest_extra: dict,
        is_best: bool = False,
    ) -> Path:
        """The folder the checkpoint of `step` is (or, saved in the background, will be) published as."""
        self.finish()
        tmp = self.begin(step)
        manifest_extra = {"step": step, **manifest_extra}
        if not self.background:
            try:
                write_files(tmp, model_cfg, model_state, manifest_extra, train_state)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # a disk that filled keeps no half-written step
                raise
            return self.commit(tmp, step, is_best)
        # Training goes on updating the tensors in place, so the thread writes copies taken now.
        memo = {}
        state = [snapshot(x, memo) for x in (model_state, train_state, manifest_extra)]
        self._writer = threading.Thread(
            target=self._write_and_commit, args=(tmp, step, model_cfg, *state, is_best), name=f"checkpoint-{step}"
        )
        self._writer.start()
        return join(self.root, step_dirname(step))

    def _write_and_commit(self, tmp, step, model_cfg, model_state, train_state, manifest_extra, is_best) -> None:
        try:
            write_files(tmp, model_cfg, model_state, manifest_extra, train_state)
            self.commit(tmp, step, is_best)
        except BaseException as e:  # re-raised in the training thread by finish()
            shutil.rmtree(tmp, ignore_errors=True)
            self._writer_error = e

    def finish(self) -> None:
        """Wait for the checkpoint being written in the background, if any; raise what it raised."""
        if self._writer is None:
            return
        self._writer.join()
        self._writer = None
        error, self._writer_error = self._writer_error, None
        if error is not None:
            raise error

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for the checkpoint of `step`."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        tmp = self.root / f".tmp-{step_dirname(step)}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, is_best: bool = False) -> Path:
        """Publish a fully written temporary folder (manifest last) as the checkpoint of `step`."""
        name = step_dirname(step)
        fsync(tmp)
        final = self.root / name
        if final.exists():  # saving the same step again (e.g. a rerun of the last step): replace it
            self._discard(final)
        os.replace(tmp, final)
        fsync(self.root)
        write_text_atomic(self.root / "latest", name + "\n")
        if is_best and self.keep_best:
            write_text_atomic(self.root / "best", name + "\n")
        self._prune(keep=name)
        return final

    def load(self, folder) -> tuple[dict, dict[str, torch.Tensor], dict]:
        """(manifest, model state dict, train state) of one verified checkpoint folder."""
        self.finish()
        folder = Path(folder)
        manifest = read_manifest(folder)
        verify(folder, manifest)
        if manifest.get("layout") == "sharded":
            # The model and optimizer shards are read by kiln.checkpoint.sharded once the model
            # has its layout; the state dict returned here is None.
            check_sharded_pickles(folder, manifest)
            return manifest, None, self._load_train_state(folder)
        if TRAIN_STATE_FILE not in manifest["files"]:
            raise CheckpointError(
                f"{folder}: weights-only checkpoint (no {TRAIN_STATE_FILE}); use init_from to start a new run from it"
            )
        model_state = restore_tied(read_safetensors(folder / MODEL_FILE), manifest.get("tied", {}), folder)
        if self.convert_state is not None:
            model_state = self.convert_state(model_state, manifest)
        return manifest, model_state, self._load_train_state(folder)

    @staticmethod
    def _load_train_state(folder: Path) -> dict:
        try:
            return torch.load(folder / TRAIN_STATE_FILE, map_location="cpu", weights_only=True)
        except Exception as e:  # checksum passed, so this is a format problem, not corruption
            raise CheckpointError(f"{folder / TRAIN_STATE_FILE}: cannot be loaded ({e})") from None

    def load_newest_valid(self, quarantine: bool = False) -> tuple[Path, dict, dict, dict] | None:
        """The newest checkpoint that verifies; damaged ones are skipped with a warning and, with
        `quarantine` (the one process that owns the folder), moved to `damaged/`."""
        self.finish()
        for folder in reversed(self._complete()):
            try:
                return (folder, *self.load(folder))
            except CheckpointError as e:
                where = f"moved to {DAMAGED_DIR}/{name_of(self.quarantine(folder))}" if quarantine else "left in place"
                warnings.warn(
                    f"skipping checkpoint {name_of(folder)}: {e}; {where}; falling back to an older one", stacklevel=2
                )
        return None

    def quarantine(self, folder: Path) -> Path:
        """Move a damaged checkpoint to `damaged/` under the root: kept for inspection, but no longer
        a step folder, so neither resume nor pruning counts it; `latest` and `best` stop naming it."""
        damaged = self.root / DAMAGED_DIR
        damaged.mkdir(exist_ok=True)
        target, n = damaged / folder.name, 1
        while target.exists():
            n += 1
            target = damaged / f"{folder.name}-{n}"
        os.replace(folder, target)
        self._repoint()
        return target

    def _repoint(self) -> None:
        """`latest` and `best` name complete folders or do not exist."""
        found = complete_checkpoints(self.root)
        latest = self.latest_name
        if latest is not None and not (self.root / latest / MANIFEST_FILE).is_file():
            if found:
                write_text_atomic(self.root / "latest", found[-1].name + "\n")
            else:
                (self.root / "latest").unlink()
        best = self.best_name
        if best is not None and not (self.root / best / MANIFEST_FILE).is_file():
            (self.root / "best").unlink()

    def rewind(self, step: int, best_step: int = -1) -> None:
        """Continue the run from `step`: checkpoints after it (corrupted ones that were skipped, or
        the future of a run resumed from an older checkpoint) are renamed `abandoned-step-*`, kept
        for inspection but no longer candidates, and `latest`/`best` are pointed back."""
        for folder in complete_checkpoints(self.root):
            if int(folder.name[len("step-") :]) > step:
                target = self.root / f"abandoned-{folder.name}"
                if target.exists():
                    shutil.rmtree(target)
                os.replace(folder, target)
                warnings.warn(f"{folder} is newer than the resumed step {step}; renamed to {target.name}", stacklevel=2)
        write_text_atomic(self.root / "latest", step_dirname(step) + "\n")
        best = self.best_name
        if best is not None and not (self.root / best / MANIFEST_FILE).is_file():
            if best_step >= 0 and (self.root / step_dirname(best_step) / MANIFEST_FILE).is_file():
                write_text_atomic(self.root / "best", step_dirname(best_step) + "\n")
            else:
                (self.root / "best").unlink()

    def _discard(self, folder: Path) -> None:
        # Rename first so a crash mid-delete never leaves a half-deleted step folder that looks
        # like a checkpoint.
        trash = self.root / f".trash-{folder.name}"
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(folder, trash)
        shutil.rmtree(trash)

    def _remove_leftovers(self) -> None:
        for p in self.root.iterdir():
            if p.is_dir() and (p.name.startswith(".tmp-step-") or p.name.startswith(".trash-step-")):
                shutil.rmtree(p)

    def _prune(self, keep: str) -> None:
        """Keep the newest `keep_last`, the best, and `keep` (the folder just published: a root that
        still holds newer step folders must not delete it the moment `latest` names it)."""
        folders = self._complete()
        keep = {keep, *(name_of(p) for p in folders[-self.keep_last :])}
        if self.keep_best and self.best_name:
            keep.add(self.best_name)
        for folder in folders:
            if name_of(folder) not in keep:
                self._discard(folder)


def snapshot(obj, memo: dict):
    """A copy of a nested state (dicts, lists, tuples, tensors) that later in-place updates of the
    original do not reach. Tensors are copied to the CPU; tensors sharing memory (a tied embedding
    and head) share their copy, so the writer still stores them once."""
    if isinstance(obj, torch.Tensor):
        key = (obj.device, obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.shape, obj.stride())
        if key not in memo or obj.numel() == 0:
            memo[key] = obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        return {k: snapshot(v, memo) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(snapshot(v, memo) for v in obj)
    return obj
