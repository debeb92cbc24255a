"""Checkpoints: one folder per step, written under a temporary name and renamed when complete.

Layout of a checkpoints root:
    step-00000100/
        model.safetensors   weights (tied tensors stored once; the manifest lists the aliases)
        train_state.pt      optimizer, grad scaler and loop counters (torch.save, weights_only-loadable)
        manifest.json       step, tokens_seen, configs, loader and RNG state, sha256 of every file,
                            and a sha256 of its own content (manifest_sha256)
    latest                  text file naming the newest complete checkpoint
    best                    text file naming the checkpoint with the lowest validation loss
A folder is complete once renamed from `.tmp-step-...`; a crash mid-write leaves only the
temporary folder, which readers ignore and the next save deletes.

Loading never unpickles anything but tensors and plain containers: the train state goes through
torch.load(weights_only=True), and a sharded (DCP) checkpoint's pickles are checked against an
allowlist before torch.distributed.checkpoint, which unpickles without one, reads them.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib
import io
import json
import os
import pickle
import random
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import DataError
from kiln.model.config import ModelConfig

MODEL_FILE = "model.safetensors"
TRAIN_STATE_FILE = "train_state.pt"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
# Row layout of the fused wqkv / w13 weights. 1: [q; k; v] and [gate; up] (before 2026-11-30);
# 2: grouped by kv head and gate/up interleaved (kiln/model/transformer.py). Older checkpoints are
# converted when they load, so they keep computing what they computed when saved.
WEIGHTS_LAYOUT = 2


class CheckpointError(DataError):
    """A checkpoint is missing, incomplete or corrupted; the message names the file."""


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    # Data must reach the disk before the rename that publishes it, or a power loss could leave
    # a "complete" folder holding empty files.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)


# ---- model weights -------------------------------------------------------------------------------


def _dedupe_tied(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory (tied embedding and head): keep one name."""
    tensors, tied, owner = {}, {}, {}
    for name, tensor in state_dict.items():
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.device.type,
        )
        if key in owner and tensor.numel() > 0:
            tied[name] = owner[key]
            continue
        owner[key] = name
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors, tied


def model_config_from_dict(d: dict, where: str) -> ModelConfig:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CheckpointError(f"{where}: model_config has unknown keys {unknown} (written by a newer Kiln?)")
    return ModelConfig(**d)


def _write_files(
    folder: Path, model_cfg: ModelConfig, state_dict: dict, manifest_extra: dict | None, train_state: dict | None
) -> dict:
    tensors, tied = _dedupe_tied(state_dict)
    save_file(tensors, str(folder / MODEL_FILE), metadata={"format": "pt"})
    names = [MODEL_FILE]
    if train_state is not None:
        torch.save(train_state, folder / TRAIN_STATE_FILE)
        names.append(TRAIN_STATE_FILE)
    return write_manifest(folder, model_cfg, names, {**(manifest_extra or {}), "tied": tied})


def _manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's content without its own checksum, over a canonical JSON form so
    that key order and whitespace do not matter."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(folder: Path, model_cfg: ModelConfig, names: list[str], manifest_extra: dict) -> dict:
    """Checksum the named files (paths relative to `folder`) and write the manifest, last: a folder
    with a manifest has all its other files in place."""
    files = {}
    for name in names:
        _fsync(folder / name)
        files[name] = {"sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
    manifest = {
        "format": FORMAT_VERSION,
        "weights_layout": WEIGHTS_LAYOUT,
        **manifest_extra,
        "model_config": dataclasses.asdict(model_cfg),
        "files": files,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
    }
    # The checksum is taken over the manifest as it will read back (tuples become lists, integer
    # keys strings), so the reader recomputes exactly the same digest. A flipped bit that keeps
    # the JSON valid (a digit of the loader position or of an RNG state) would otherwise resume a
    # run silently wrong.
    manifest = json.loads(json.dumps(manifest))
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    _write_text_atomic(folder / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest


def save_weights(folder, model_cfg: ModelConfig, state_dict: dict, manifest_extra: dict | None = None) -> Path:
    """Write a weights-only checkpoint (model.safetensors + manifest.json) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_files(folder, model_cfg, state_dict, manifest_extra, train_state=None)
    return folder


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (incomplete checkpoint)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupted manifest ({e})") from None
    if not isinstance(manifest, dict) or "model_config" not in manifest or "files" not in manifest:
        raise CheckpointError(f"{path}: not a Kiln checkpoint manifest (no model_config/files)")
    # Manifests written before the self-checksum existed have none; they are still read.
    if "manifest_sha256" in manifest and manifest["manifest_sha256"] != _manifest_digest(manifest):
        raise CheckpointError(f"{path}: content does not match its manifest_sha256 (corrupted manifest)")
    return manifest


def verify(folder: Path, manifest: dict, names=None) -> None:
    """Check size and sha256 of the checkpoint's files against its manifest."""
    folder = Path(folder)
    for name, expected in manifest["files"].items():
        if names is not None and name not in names:
            continue
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (incomplete checkpoint)")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, manifest says {expected['bytes']} (truncated file)")
        if sha256_file(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: sha256 does not match the manifest (corrupted file)")


# ---- pickles of sharded (DCP) checkpoints ------------------------------------------------------

_DCP_DIR = "sharded"
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
    non-tensor entries (optimizer hyperparameters) are loaded by kiln.parallel.checkpoint's
    WeightsOnlyLoadPlanner with weights_only=True; they are also checked here, before any model is
    built, so that resume=auto can fall back to an earlier checkpoint instead of failing mid-load."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    folder = Path(folder)
    meta_path = folder / _DCP_DIR / ".metadata"
    listed = set(manifest["files"])
    if f"{_DCP_DIR}/.metadata" not in listed:
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
        if info is None or f"{_DCP_DIR}/{relative}" not in listed:
            raise CheckpointError(f"{meta_path}: entry {key!r} points to {relative!r}, not a file of this checkpoint")
        if getattr(info, "transform_descriptors", None):  # compressed or otherwise encoded: cannot check
            raise CheckpointError(f"{meta_path}: entry {key!r} is stored transformed; Kiln cannot check it")
        with open(folder / _DCP_DIR / relative, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"{folder / _DCP_DIR / relative}: entry {key!r} is not plain data; refusing "
                f"to unpickle it ({type(e).__name__}: {str(e).splitlines()[0]})"
            ) from None


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished step folders under `root`, oldest first (temporary folders are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step-") and (p / MANIFEST_FILE).is_file():
            try:
                found.append((int(p.name[len("step-") :]), p))
            except ValueError:
                continue
    return [p for _, p in sorted(found)]


def resolve_checkpoint(path) -> Path:
    """A checkpoint folder from a folder, a checkpoints root (via `latest`) or a stage folder."""
    p = Path(path)
    if p.is_file() and p.name in (MANIFEST_FILE, MODEL_FILE):
        p = p.parent
    elif p.is_file() and p.suffix.lower() in (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"):
        raise CheckpointError(
            f"{path}: a pickled file, which Kiln does not load (unpickling can run code); "
            f"a Kiln checkpoint is a folder with {MODEL_FILE} and {MANIFEST_FILE}. "
            f"Import Hugging Face safetensors weights with `kiln import hf`"
        )
    if not p.exists():
        raise CheckpointError(f"{path}: no such checkpoint")
    if (p / MANIFEST_FILE).is_file():
        return p
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    found = complete_checkpoints(p)
    if (p / "latest").is_file():
        name = (p / "latest").read_text().strip()
        if (p / name / MANIFEST_FILE).is_file():
            return p / name
        # A process killed between moving checkpoints aside (rewind) and rewriting the pointer
        # leaves it naming a folder that is gone; the newest complete one is what it would name.
        if not found:
            raise CheckpointError(f"{p / 'latest'}: names {name!r}, which is not a complete checkpoint")
        warnings.warn(
            f"{p / 'latest'} names {name!r}, which is not a complete checkpoint; "
            f"using the newest complete one, {found[-1].name}",
            stacklevel=2,
        )
    if found:
        return found[-1]
    raise CheckpointError(
        f"{path}: not a checkpoint folder, a checkpoints root, or a stage folder containing checkpoints/"
    )


def upgrade_layout(state: dict, model_cfg: ModelConfig, manifest: dict) -> dict:
    """Convert a state dict saved with an older fused-row layout to the current one (in place)."""
    if manifest.get("weights_layout", 1) >= WEIGHTS_LAYOUT:
        return state
    from kiln.model.transformer import fuse_gate_up, fuse_qkv

    q_rows, kv_rows = model_cfg.n_heads * model_cfg.head_dim, model_cfg.kv_heads * model_cfg.head_dim
    for i in range(model_cfg.n_layers):
        for suffix in ("weight", "bias"):
            name = f"layers.{i}.attn.wqkv.{suffix}"
            if name in state:
                state[name] = fuse_qkv(*state[name].split([q_rows, kv_rows, kv_rows]), model_cfg.kv_heads)
        name = f"layers.{i}.ffn.w13.weight"
        if name in state:
            state[name] = fuse_gate_up(*state[name].chunk(2))
    return state


def _restore_tied(state: dict, tied: dict, where: Path) -> dict:
    for alias, name in tied.items():
        if name not in state:
            raise CheckpointError(f"{where}: tied tensor {alias!r} refers to missing {name!r}")
        state[alias] = state[name]
    return state


def load_weights(path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(model config, state dict on CPU, manifest) of a checkpoint; checksums are verified."""
    folder = resolve_checkpoint(path)
    manifest = read_manifest(folder)
    cfg = model_config_from_dict(manifest["model_config"], str(folder / MANIFEST_FILE))
    if manifest.get("layout") == "sharded":
        from kiln.parallel.checkpoint import load_sharded_weights

        verify(folder, manifest)
        check_sharded_pickles(folder, manifest)
        return cfg, load_sharded_weights(folder), manifest
    verify(folder, manifest, names=[MODEL_FILE])
    state = _restore_tied(load_file(str(folder / MODEL_FILE)), manifest.get("tied", {}), folder / MODEL_FILE)
    return cfg, upgrade_layout(state, cfg, manifest), manifest


# ---- RNG state as JSON ---------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """Every RNG the process uses, JSON-serialisable (byte states as base64)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


# ---- training checkpoints ------------------------------------------------------------------------


class CheckpointManager:
    """Saves, finds, verifies and prunes the step folders of one run's checkpoints root."""

    def __init__(self, root, keep_last: int = 2, keep_best: bool = True):
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_best = keep_best

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
        model_cfg: ModelConfig,
        model_state: dict,
        train_state: dict,
        manifest_extra: dict,
        is_best: bool = False,
    ) -> Path:
        tmp = self.begin(step)
        _write_files(tmp, model_cfg, model_state, {"step": step, **manifest_extra}, train_state)
        return self.commit(tmp, step, is_best)

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
        _fsync(tmp)
        final = self.root / name
        if final.exists():  # saving the same step again (e.g. a rerun of the last step): replace it
            self._discard(final)
        os.replace(tmp, final)
        _fsync(self.root)
        _write_text_atomic(self.root / "latest", name + "\n")
        if is_best and self.keep_best:
            _write_text_atomic(self.root / "best", name + "\n")
        self._prune()
        return final

    def load(self, folder) -> tuple[dict, dict[str, torch.Tensor], dict]:
        """(manifest, model state dict, train state) of one verified checkpoint folder."""
        folder = Path(folder)
        manifest = read_manifest(folder)
        verify(folder, manifest)
        if manifest.get("layout") == "sharded":
            # The model and optimizer shards are read by kiln.parallel.checkpoint once the model
            # has its layout; the state dict returned here is None.
            check_sharded_pickles(folder, manifest)
            return manifest, None, self._load_train_state(folder)
        if TRAIN_STATE_FILE not in manifest["files"]:
            raise CheckpointError(
                f"{folder}: weights-only checkpoint (no {TRAIN_STATE_FILE}); use init_from to start a new run from it"
            )
        model_state = _restore_tied(load_file(str(folder / MODEL_FILE)), manifest.get("tied", {}), folder)
        cfg = model_config_from_dict(manifest["model_config"], str(folder / MANIFEST_FILE))
        return manifest, upgrade_layout(model_state, cfg, manifest), self._load_train_state(folder)

    @staticmethod
    def _load_train_state(folder: Path) -> dict:
        try:
            return torch.load(folder / TRAIN_STATE_FILE, map_location="cpu", weights_only=True)
        except Exception as e:  # checksum passed, so this is a format problem, not corruption
            raise CheckpointError(f"{folder / TRAIN_STATE_FILE}: cannot be loaded ({e})") from None

    def load_newest_valid(self) -> tuple[Path, dict, dict, dict] | None:
        """The newest checkpoint that verifies; corrupted ones are skipped with a warning."""
        for folder in reversed(complete_checkpoints(self.root)):
            try:
                return (folder, *self.load(folder))
            except CheckpointError as e:
                warnings.warn(f"skipping checkpoint {folder.name}: {e}; falling back to an older one", stacklevel=2)
        return None

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
        _write_text_atomic(self.root / "latest", step_dirname(step) + "\n")
        best = self.best_name
        if best is not None and not (self.root / best / MANIFEST_FILE).is_file():
            if best_step >= 0 and (self.root / step_dirname(best_step) / MANIFEST_FILE).is_file():
                _write_text_atomic(self.root / "best", step_dirname(best_step) + "\n")
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

    def _prune(self) -> None:
        folders = complete_checkpoints(self.root)
        keep = {p.name for p in folders[-self.keep_last :]}
        if self.keep_best and self.best_name:
            keep.add(self.best_name)
        for folder in folders:
            if folder.name not in keep:
                self._discard(folder)
