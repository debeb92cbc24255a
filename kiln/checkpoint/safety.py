"""What Kiln refuses to unpickle. A sharded (torch.distributed.checkpoint) checkpoint holds pickles:
its `.metadata` and the non-tensor entries (optimizer hyperparameters). DCP's reader and default
load planner unpickle them without restriction, so they are checked here against an allowlist
before DCP reads them, and loaded through a planner that uses torch.load(weights_only=True)."""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from kiln.checkpoint.format import CheckpointError

# ---- pickles of sharded (DCP) checkpoints ------------------------------------------------------

SHARDED_DIR = "sharded"
# What torch.distributed.checkpoint's `.metadata` pickle refers to: its own metadata classes,
# torch.Size, dtypes and layouts, paths. Anything else (os.system, builtins.eval...) means the
# file was crafted, and loading it would run code.
_DCP_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str):
        allowed = (module, name) in _DCP_GLOBALS
        if module == "torch":
            allowed = allowed or isinstance(getattr(torch, name, None), torch.dtype)
        elif module in _DCP_CLASS_MODULES:  # classes defined there, not the functions it imports
            obj = getattr(importlib.import_module(module), name, None)
            allowed = isinstance(obj, type) and obj.__module__ == module
        if not allowed:
            raise CheckpointError(
                f"{self.where}: refers to {module}.{name}, which a checkpoint never holds; "
                f"refusing to unpickle it (the file may have been crafted to run code)"
            )
        return super().find_class(module, name)


def check_sharded_pickles(folder: Path, manifest: dict) -> None:
    """Refuse a sharded checkpoint whose pickled parts could run code when loaded.

    torch.distributed.checkpoint's reader unpickles `.metadata` without restriction; it is read here
    first with an allowlisted unpickler, so whatever passes names only allowlisted globals. The
    non-tensor entries (optimizer hyperparameters) are loaded by the WeightsOnlyLoadPlanner
    below with weights_only=True; they are also checked here, before any model is
    built, so that resume=auto can fall back to an earlier checkpoint instead of failing mid-load."""
    folder = Path(folder)
    meta_path = folder / SHARDED_DIR / ".metadata"
    listed = set(manifest["files"])
    if f"{SHARDED_DIR}/.metadata" not in listed:
        raise CheckpointError(f"{meta_path}: not listed in the manifest")
    try:
        with open(meta_path, "rb") as f:
            metadata = _MetadataUnpickler(f, meta_path).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{meta_path}: cannot be read ({type(e).__name__}: {e})") from None
    storage = getattr(metadata, "storage_data", None) or {}
    for key, item in getattr(metadata, "state_dict_metadata", {}).items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = storage.get(MetadataIndex(key))
        relative = str(getattr(info, "relative_path", None))
        if info is None or f"{SHARDED_DIR}/{relative}" not in listed:
            raise CheckpointError(f"{meta_path}: entry {key!r} points to {relative!r}, not a file of this checkpoint")
        if getattr(info, "transform_descriptors", None):  # compressed or otherwise encoded: cannot check
            raise CheckpointError(f"{meta_path}: entry {key!r} is stored transformed; Kiln cannot check it")
        with open(folder / SHARDED_DIR / relative, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"{folder / SHARDED_DIR / relative}: entry {key!r} is not plain data; refusing "
                f"to unpickle it ({type(e).__name__}: {str(e).splitlines()[0]})"
            ) from None


class WeightsOnlyLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, except that the non-tensor entries of a checkpoint (optimizer
    hyperparameters, step counters) are unpickled with weights_only=True: the default planner
    unpickles them without restriction, so a crafted checkpoint could run code on load."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
