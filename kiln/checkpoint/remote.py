"""Checkpoints roots on object stores (any fsspec URL: `s3://bucket/run/checkpoints`).

An object store has no rename, so a checkpoint is published the other way round: written whole into
a local staging folder (the same files and manifest as on disk), then uploaded file by file with the
manifest last (kiln.storage.publish_folder). A step folder is a checkpoint exactly when its
manifest is there; an upload killed part way leaves files without one, which nothing lists or loads,
and the next save of that step overwrites. `latest` and `best` are single objects written after the
manifest. Reading copies a published folder into the local cache (keyed by its manifest's digest),
checks every file against the manifest, and loads the copy with the local code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from kiln import storage
from kiln.checkpoint import format as local
from kiln.checkpoint.format import MANIFEST_FILE, CheckpointError, read_manifest, step_dirname, verify
from kiln.checkpoint.manager import DAMAGED_DIR, CheckpointManager


def complete_checkpoints(root) -> list:
    """Published step folders under `root`, oldest first: local Paths, or URLs for a remote root
    (a remote folder counts once its manifest is there)."""
    if not storage.is_remote(root):
        return local.complete_checkpoints(root)
    found = []
    for manifest in storage.glob(storage.join(root, "step-*", MANIFEST_FILE)):
        folder = storage.parent_of(manifest)
        try:
            found.append((int(storage.name_of(folder)[len("step-") :]), folder))
        except ValueError:
            continue
    return [folder for _, folder in sorted(found)]


def fetch_checkpoint(folder: str) -> Path:
    """A local copy of the published remote checkpoint `folder`, every file checked against its
    manifest. Copies are cached by manifest digest, so a folder re-saved under the same step is
    fetched afresh."""
    url = storage.join(folder, MANIFEST_FILE)
    try:
        data = storage.read_bytes(url)
    except FileNotFoundError:
        raise CheckpointError(f"{url}: missing (incomplete checkpoint)") from None
    target = storage.cache_path(folder, hashlib.sha256(data).hexdigest())
    if (target / MANIFEST_FILE).is_file():
        try:
            verify(target, read_manifest(target))
            return target
        except CheckpointError:
            shutil.rmtree(target)  # a damaged cached copy: fetch again
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=_mkdir(target.parent)))
    try:
        (staging / MANIFEST_FILE).write_bytes(data)
        manifest = read_manifest(staging)
        for name in manifest["files"]:
            try:
                storage.download(storage.join(folder, name), staging / name)
            except FileNotFoundError:
                raise CheckpointError(f"{storage.join(folder, name)}: missing (incomplete checkpoint)") from None
        verify(staging, manifest)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_checkpoint(path, pointer: str = "best") -> Path:
    """kiln.checkpoint.format.resolve_checkpoint for any path, with its one rule for a root (the
    folder `pointer` names, else `latest`'s, else the newest complete one); a remote checkpoint (a
    folder, a checkpoints root, or a stage folder holding checkpoints/) comes back as its verified
    local copy."""
    if not storage.is_remote(path):
        return local.resolve_checkpoint(path, pointer)
    root = str(path).rstrip("/")
    if storage.isfile(storage.join(root, MANIFEST_FILE)):
        return fetch_checkpoint(root)
    if storage.isdir(storage.join(root, "checkpoints")):
        root = storage.join(root, "checkpoints")
    found = complete_checkpoints(root)
    for name_file in dict.fromkeys((pointer, "latest")):
        named = storage.join(root, name_file)
        if storage.isfile(named):
            name = storage.read_text(named).strip()
            if storage.isfile(storage.join(root, name, MANIFEST_FILE)):
                return fetch_checkpoint(storage.join(root, name))
            if found:
                warnings.warn(
                    f"{named} names {name!r}, which is not a complete checkpoint; using {found[-1]}", stacklevel=2
                )
    if found:
        return fetch_checkpoint(found[-1])
    raise CheckpointError(f"{path}: no published checkpoint (no step folder with its {MANIFEST_FILE})")


class RemoteCheckpointManager(CheckpointManager):
    """CheckpointManager over a remote root: the same saves, loads, pointers, rewind and pruning,
    published manifest last instead of by rename."""

    def __init__(self, root, *args, **kwargs):
        super().__init__(root, *args, **kwargs)
        self.root = str(root).rstrip("/")

    def _complete(self) -> list:
        return complete_checkpoints(self.root)

    def _pointer(self, name: str) -> str | None:
        path = storage.join(self.root, name)
        return storage.read_text(path).strip() if storage.isfile(path) else None

    def _set_pointer(self, name: str, value: str | None) -> None:
        if value is None:
            storage.remove(storage.join(self.root, name))
        else:
            storage.write_bytes(storage.join(self.root, name), f"{value}\n".encode())

    def _published(self, name: str) -> bool:
        return storage.isfile(storage.join(self.root, name, MANIFEST_FILE))

    def holds(self, folder) -> bool:
        return storage.is_remote(folder) and storage.parent_of(str(folder).rstrip("/")) == self.root

    def begin(self, step: int) -> Path:
        """A local staging folder; it is uploaded by commit."""
        return Path(tempfile.mkdtemp(prefix=f"kiln-{step_dirname(step)}-"))

    def commit(self, tmp: Path, step: int, is_best: bool = False) -> str:
        name = step_dirname(step)
        final = storage.join(self.root, name)
        try:
            storage.publish_folder(tmp, final, MANIFEST_FILE)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._set_pointer("latest", name)
        if is_best and self.keep_best:
            self._set_pointer("best", name)
        self._prune(keep=name)
        return final

    def load(self, folder):
        self.finish()
        return super().load(fetch_checkpoint(folder) if storage.is_remote(folder) else folder)

    def _move(self, folder: str, target: str) -> None:
        """Copy, then unpublish the original (manifest first) and delete it: a reader sees the
        checkpoint at one of the two names, never half of it at either."""
        fs = storage.filesystem(folder)
        names = [p[len(folder) + 1 :] for p in storage.walk_files(folder)]
        for rel in sorted(names, key=lambda rel: rel == MANIFEST_FILE):
            fs.copy(storage.join(folder, rel), storage.join(target, rel))
        self._discard(folder)

    def quarantine(self, folder) -> str:
        target, n = storage.join(self.root, DAMAGED_DIR, storage.name_of(folder)), 1
        while storage.exists(target):
            n += 1
            target = storage.join(self.root, DAMAGED_DIR, f"{storage.name_of(folder)}-{n}")
        self._move(folder, target)
        self._repoint()
        return target

    def _repoint(self) -> None:
        found = self._complete()
        latest = self.latest_name
        if latest is not None and not self._published(latest):
            self._set_pointer("latest", storage.name_of(found[-1]) if found else None)
        best = self.best_name
        if best is not None and not self._published(best):
            self._set_pointer("best", None)

    def rewind(self, step: int, best_step: int = -1) -> None:
        for folder in self._complete():
            if int(storage.name_of(folder)[len("step-") :]) > step:
                target = storage.join(self.root, f"abandoned-{storage.name_of(folder)}")
                storage.remove(target, recursive=True)
                self._move(folder, target)
                warnings.warn(f"{folder} is newer than the resumed step {step}; moved to {target}", stacklevel=2)
        self._set_pointer("latest", step_dirname(step))
        best = self.best_name
        if best is not None and not self._published(best):
            keep = best_step >= 0 and self._published(step_dirname(best_step))
            self._set_pointer("best", step_dirname(best_step) if keep else None)

    def _discard(self, folder) -> None:
        # The manifest goes first, so a delete cut short leaves an unpublished folder, not a
        # checkpoint with missing files.
        storage.remove(storage.join(folder, MANIFEST_FILE))
        storage.remove(folder, recursive=True)


def checkpoint_manager(root, *args, **kwargs) -> CheckpointManager:
    """The manager of a checkpoints root: on local disk (rename publish) or remote (manifest last)."""
    cls = RemoteCheckpointManager if storage.is_remote(root) else CheckpointManager
    return cls(root, *args, **kwargs)
