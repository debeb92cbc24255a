"""The checkpoint format: one folder per step, written under a temporary name and renamed when
complete. This module is the bottom layer's file format and knows nothing of the model: the model
config is stored as the plain dict of whatever dataclass the caller passes.

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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kiln.errors import DataError
from kiln.files import fsync, publishing, write_text_atomic

MODEL_FILE = "model.safetensors"
TRAIN_STATE_FILE = "train_state.pt"
MANIFEST_FILE = "manifest.json"
# 1: the first manifests (before 2026-11-30 15:45 they had no manifest_sha256); 2: the same fields,
# manifest_sha256 required. A version-1 manifest without its checksum is still read; from version 2
# a missing checksum is damage, so deleting the field cannot switch the self-check off.
FORMAT_VERSION = 2
CHECKSUMMED_FROM_VERSION = 2
# Row layout of the fused weights. 1: wqkv [q; k; v], SwiGLU's w13 [gate; up] (before 2026-11-30);
# 2: wqkv grouped by kv head, w13 gate/up rows interleaved; 3: wqkv as 2, gate and up as separate
# w1 and w3 (2026-12-03; kiln/model/transformer.py). Older checkpoints are converted when they load
# (kiln.model.weights.upgrade_layout), so they keep computing what they computed when saved.
WEIGHTS_LAYOUT = 3


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


# ---- model weights -------------------------------------------------------------------------------

# What a file that is not safetensors usually is, from its first bytes: a torch.save zip archive,
# a bare pickle (protocol 2 and up start with 0x80), an HTML error page saved by a failed download.
_LOOKALIKES = ((b"PK\x03\x04", "a zip archive (torch.save)"), (b"\x80", "a pickle"), (b"<", "HTML or XML text"))


def read_safetensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file. A file that is not one (a pickle renamed
    `model.safetensors`, a truncated download) is a CheckpointError naming the path and, when the
    first bytes tell, what the file is instead. safetensors never runs the file's content."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except (SafetensorError, OSError) as err:
        with open(path, "rb") as fh:
            head = fh.read(4)
        what = next((name for magic, name in _LOOKALIKES if head.startswith(magic)), None)
        found = f"it is {what}" if what else f"{path.stat().st_size} bytes that do not parse: damaged or cut short"
        raise CheckpointError(f"{path}: not a safetensors file ({found}; {err})") from None


def dedupe_tied(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
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


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `tensors` to `path` as safetensors, published when complete (kiln.files.publishing)."""
    with publishing(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def write_files(
    folder: Path, model_cfg, state_dict: dict, manifest_extra: dict | None, train_state: dict | None
) -> dict:
    tensors, tied = dedupe_tied(state_dict)
    write_safetensors(tensors, folder / MODEL_FILE)
    names = [MODEL_FILE]
    if train_state is not None:
        with publishing(folder / TRAIN_STATE_FILE) as tmp:
            torch.save(train_state, tmp)
        names.append(TRAIN_STATE_FILE)
    return write_manifest(folder, model_cfg, names, {**(manifest_extra or {}), "tied": tied})


def _manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's content without its own checksum, over a canonical JSON form so
    that key order and whitespace do not matter."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(folder: Path, model_cfg, names: list[str], manifest_extra: dict) -> dict:
    """Checksum the named files (paths relative to `folder`) and write the manifest, last: a folder
    with a manifest has all its other files in place."""
    files = {}
    for name in names:
        fsync(folder / name)
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
    write_text_atomic(folder / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest


def save_weights(folder, model_cfg, state_dict: dict, manifest_extra: dict | None = None) -> Path:
    """Write a weights-only checkpoint (model.safetensors + manifest.json) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_files(folder, model_cfg, state_dict, manifest_extra, train_state=None)
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
    check_manifest_schema(manifest, path)
    if "manifest_sha256" not in manifest:
        # Only manifests older than the self-checksum may lack it.
        if manifest.get("format", 1) >= CHECKSUMMED_FROM_VERSION:
            raise CheckpointError(
                f"{path}: field 'manifest_sha256' is missing, which a format {manifest['format']} manifest "
                f"always has (edited or damaged manifest)"
            )
    elif manifest["manifest_sha256"] != _manifest_digest(manifest):
        raise CheckpointError(f"{path}: content does not match its manifest_sha256 (corrupted manifest)")
    return manifest


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float))) and not isinstance(value, bool)


# Field -> (what it must be, check). Fields a checkpoint may lack are checked when present; the
# required ones (model_config, files) were checked for presence before.
_MANIFEST_FIELDS = {
    "format": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "weights_layout": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "step": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "tokens_seen": ("an integer >= 0", lambda v: _is_int(v) and v >= 0),
    "val_loss": ("a number or null", lambda v: v is None or _is_number(v)),
    "model_config": ("an object", lambda v: isinstance(v, dict)),
    "train_config": ("an object", lambda v: isinstance(v, dict)),
    "recipe": ("an object or null", lambda v: v is None or isinstance(v, dict)),
    "loader": ("an object", lambda v: isinstance(v, dict)),
    "rng": ("an object", lambda v: isinstance(v, dict)),
    "schedule": ("an object", lambda v: isinstance(v, dict)),
    "layout": ("a string", lambda v: isinstance(v, str)),
    "tied": (
        "an object of tensor name -> tensor name",
        lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    ),
    "files": ("an object of file name -> {sha256, bytes}", lambda v: isinstance(v, dict)),
    "manifest_sha256": ("a string", lambda v: isinstance(v, str)),
}


def check_manifest_schema(manifest: dict, path: Path) -> None:
    """The types of the manifest's fields: a manifest that parses but holds the wrong kind of value
    is damage, named by file and field, like a failed checksum (so resume falls back past it)."""
    for field, (expected, ok) in _MANIFEST_FIELDS.items():
        if field in manifest and not ok(manifest[field]):
            raise CheckpointError(f"{path}: field {field!r} must be {expected}, got {manifest[field]!r:.80}")
    if manifest.get("format", 1) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: field 'format' is {manifest['format']}, newer than this Kiln reads ({FORMAT_VERSION})"
        )
    for name, entry in manifest["files"].items():
        where = f"files[{name!r}]"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: field {where} must be an object with sha256 and bytes, got {entry!r:.80}")
        digest, size = entry.get("sha256"), entry.get("bytes")
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise CheckpointError(f"{path}: field {where}.sha256 must be 64 hex digits, got {digest!r:.80}")
        if not (_is_int(size) and size >= 0):
            raise CheckpointError(f"{path}: field {where}.bytes must be an integer >= 0, got {size!r:.80}")
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{path}: field {where} names a file outside the checkpoint folder")


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


def resolve_checkpoint(path, pointer: str = "best") -> Path:
    """A checkpoint folder from a folder, a checkpoints root or a stage folder (one holding
    checkpoints/). The one rule for a root: the checkpoint its `pointer` file names (`best`, the
    lowest validation loss, for every verb that loads a model; resume passes `latest`), else the
    one `latest` names, else the newest complete step folder."""
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
    broken = []
    for name_file in dict.fromkeys((pointer, "latest")):
        name = (p / name_file).read_text().strip() if (p / name_file).is_file() else None
        if name is not None and (p / name / MANIFEST_FILE).is_file():
            if broken:
                warnings.warn(f"{broken[0]}, which is not a complete checkpoint; using {name_file}", stacklevel=2)
            return p / name
        if name is not None:
            broken.append(f"{p / name_file} names {name!r}")
    # A process killed between moving checkpoints aside (rewind) and rewriting the pointers leaves
    # them naming a folder that is gone; the newest complete one is what they would name.
    if broken and not found:
        raise CheckpointError(f"{broken[0].replace(' names ', ': names ', 1)}, which is not a complete checkpoint")
    if broken:
        warnings.warn(
            f"{broken[0]}, which is not a complete checkpoint; using the newest complete one, {found[-1].name}",
            stacklevel=2,
        )
    if found:
        return found[-1]
    raise CheckpointError(
        f"{path}: not a checkpoint folder, a checkpoints root, or a stage folder containing checkpoints/"
    )


def _names(pointer: Path, folder: Path) -> bool:
    return pointer.read_text().strip() == folder.name


def loaded_line(folder: Path, manifest: dict) -> str:
    """The one line every loading verb prints: which checkpoint folder, and the step it holds."""
    step = manifest.get("step")
    folder = Path(folder)
    which = [n for n in ("best", "latest") if (folder.parent / n).is_file() and _names(folder.parent / n, folder)]
    return f"loaded checkpoint {folder} (step {step if step is not None else '?'}{', ' + ' and '.join(which) if which else ''})"


def restore_tied(state: dict, tied: dict, where: Path) -> dict:
    for alias, name in tied.items():
        if name not in state:
            raise CheckpointError(f"{where}: tied tensor {alias!r} refers to missing {name!r}")
        state[alias] = state[name]
    return state


def load_single_file_state(folder: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The verified model state dict of a single-file checkpoint, tied aliases restored."""
    verify(folder, manifest, names=[MODEL_FILE])
    return restore_tied(read_safetensors(folder / MODEL_FILE), manifest.get("tied", {}), folder / MODEL_FILE)
