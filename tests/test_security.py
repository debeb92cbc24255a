"""Loading files from an unknown source never runs code they carry, and API keys are compared in
constant time.

Each refusal is checked against a live payload: a pickle whose unpickling writes a marker file. The
payload is first shown to work (plain pickle runs it), so "the marker never appears" means the
loader refused it, not that the payload was inert.
"""

import ast
import hmac
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.checkpoint import (
    TRAIN_STATE_FILE,
    CheckpointError,
    CheckpointManager,
    read_manifest,
    resolve_checkpoint,
    sha256_file,
)
from kiln.errors import DataError
from kiln.hf import import_hf
from kiln.model import ModelConfig, build_model
from kiln.model.weights import load_weights

REPO = Path(__file__).resolve().parents[1]
CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


class Payload:
    """Unpickling calls exec, which writes `marker`: what a malicious checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "pwned"
    # The payload is live: an unrestricted unpickler runs it.
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Payload(probe)))
    assert probe.read_text() == "pwned"
    return path


def _evil_torch_file(path: Path, marker: Path) -> None:
    torch.save({"weights": torch.zeros(2), "loop": Payload(marker)}, path)


def _rewrite_manifest_checksums(folder: Path, added: tuple[str, ...] = ()) -> None:
    """What an attacker who ships a whole checkpoint does: checksums that match the planted files."""
    from kiln.checkpoint.format import _manifest_digest

    manifest = read_manifest(folder)
    for name in [*manifest["files"], *added]:
        manifest["files"][name] = {"sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _train_state(model):
    from kiln.train.config import TrainConfig
    from kiln.train.optim import build_optimizer

    opt = build_optimizer(model, TrainConfig())
    model(torch.randint(0, 64, (2, 8))).float().mean().backward()
    opt.step()
    return opt, {"optimizer": opt.state_dict(), "scaler": {}, "loop": {"step": 1}}


# ---- Hugging Face import ------------------------------------------------------------------------


def _hf_folder(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 32,
                "num_attention_heads": 4,
                "num_hidden_layers": 1,
                "intermediate_size": 64,
                "vocab_size": 64,
            }
        )
    )
    return folder


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.ckpt", "weights.pkl"])
def test_import_hf_refuses_pickled_weights(tmp_path, marker, name):
    folder = _hf_folder(tmp_path / "hf")
    _evil_torch_file(folder / name, marker)
    with pytest.raises(DataError, match=rf"found only pickled weights \({name}\).*convert them to safetensors"):
        import_hf(folder)
    assert not marker.exists()


def test_import_hf_refuses_a_pickle_named_in_the_safetensors_index(tmp_path, marker):
    folder = _hf_folder(tmp_path / "hf")
    _evil_torch_file(folder / "pytorch_model-00001.bin", marker)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "pytorch_model-00001.bin"}}))
    with pytest.raises(DataError, match="pytorch_model-00001.bin is a pickled weight file"):
        import_hf(folder)
    # The index cannot reach outside the model folder either.
    index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}}))
    with pytest.raises(DataError, match="not a file name inside"):
        import_hf(folder)
    assert not marker.exists()


def test_kiln_import_hf_cli_refuses_pickles(tmp_path, marker):
    folder = _hf_folder(tmp_path / "hf")
    _evil_torch_file(folder / "pytorch_model.bin", marker)
    done = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "import", "hf", str(folder), str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    assert "pytorch_model.bin" in done.stderr and "safetensors" in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_pickled_file_is_not_taken_for_a_checkpoint(tmp_path, marker):
    _evil_torch_file(tmp_path / "model.pt", marker)
    with pytest.raises(CheckpointError, match="model.pt: a pickled file, which Kiln does not load"):
        resolve_checkpoint(tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="pickled file"):
        load_weights(tmp_path / "model.pt")
    assert not marker.exists()


# ---- files that are not what their name says ---------------------------------------------------


def _fake_safetensors(path: Path, kind: str, marker: Path) -> str:
    """Overwrite `path` with something else under its safetensors name; the words the error uses."""
    good = path.read_bytes()
    if kind == "torch_save":
        _evil_torch_file(path, marker)
        return "it is a zip archive"
    if kind == "pickle":
        path.write_bytes(pickle.dumps(Payload(marker)))
        return "it is a pickle"
    path.write_bytes(good[: len(good) - 7])  # a download cut short
    return r"\d+ bytes that do not parse: damaged or cut short"


def _weights_folders(tmp_path: Path) -> dict[str, tuple[Path, object]]:
    """Every place Kiln reads a safetensors file: (the file, how Kiln loads its folder)."""
    from kiln.checkpoint import save_weights
    from kiln.hf import export_hf
    from kiln.peft import PeftConfig, apply_peft, load_peft_adapter, load_trainable, save_peft_adapter
    from kiln.peft.peft_io import save_trainable

    model = build_model(CFG)
    peft_cfg = PeftConfig(method="lora", r=2, alpha=4, targets=["attn.wo"])
    lora = apply_peft(build_model(CFG), peft_cfg)
    save_weights(tmp_path / "ckpt", CFG, model.state_dict())
    export_hf(CFG, model.state_dict(), None, tmp_path / "hf")
    save_peft_adapter(lora, CFG, tmp_path / "adapter", peft_cfg)
    save_trainable(lora, peft_cfg, tmp_path / "trainable")
    return {
        "checkpoint": (tmp_path / "ckpt" / "model.safetensors", lambda: load_weights(tmp_path / "ckpt")),
        "hf": (tmp_path / "hf" / "model.safetensors", lambda: import_hf(tmp_path / "hf")),
        "peft": (
            tmp_path / "adapter" / "adapter_model.safetensors",
            lambda: load_peft_adapter(build_model(CFG), tmp_path / "adapter"),
        ),
        "trainable": (
            tmp_path / "trainable" / "kiln_peft.safetensors",
            lambda: load_trainable(apply_peft(build_model(CFG), peft_cfg), tmp_path / "trainable"),
        ),
    }


@pytest.mark.parametrize("kind", ["torch_save", "pickle", "truncated"])
def test_a_file_that_is_not_safetensors_is_named_wherever_weights_load(tmp_path, marker, kind):
    """A pickle renamed model.safetensors, or a truncated file: one DataError naming the path and what
    the file is, from the checkpoint loader, `kiln import hf` and both adapter formats; never
    safetensors' own SafetensorError, and the payload never runs."""
    for where, (path, load) in _weights_folders(tmp_path).items():
        load()  # the genuine file loads
        words = _fake_safetensors(path, kind, marker)
        if where == "checkpoint":
            _rewrite_manifest_checksums(path.parent)  # a shipped checkpoint's checksums match its files
        with pytest.raises(DataError, match=re.escape(f"{path}: not a safetensors file (") + words) as err:
            load()
        assert isinstance(err.value, DataError), where
    assert not marker.exists()


def test_kiln_import_hf_cli_names_a_pickle_renamed_safetensors(tmp_path, marker):
    from kiln.hf import export_hf

    export_hf(CFG, build_model(CFG).state_dict(), None, tmp_path / "hf")
    _fake_safetensors(tmp_path / "hf" / "model.safetensors", "torch_save", marker)
    done = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "import", "hf", str(tmp_path / "hf"), str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    assert "model.safetensors: not a safetensors file (it is a zip archive" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not marker.exists()


# ---- Kiln checkpoints ---------------------------------------------------------------------------


def test_crafted_train_state_is_refused(tmp_path, marker):
    torch.manual_seed(0)
    model = build_model(CFG)
    _, state = _train_state(model)
    manager = CheckpointManager(tmp_path / "ckpt")
    folder = manager.save(1, CFG, model.state_dict(), state, {"tokens_seen": 1})
    _evil_torch_file(folder / TRAIN_STATE_FILE, marker)
    _rewrite_manifest_checksums(folder)
    with pytest.raises(CheckpointError, match=f"{TRAIN_STATE_FILE}: cannot be loaded"):
        manager.load(folder)
    assert not marker.exists()


def _sharded_checkpoint(root: Path) -> Path:
    import warnings

    from kiln.checkpoint import ShardedSaver

    torch.manual_seed(0)
    model = build_model(CFG)
    opt, state = _train_state(model)
    del state["optimizer"]
    with warnings.catch_warnings():  # DCP in one process without a process group: intended here
        warnings.simplefilter("ignore", UserWarning)
        ShardedSaver(CheckpointManager(root)).save(1, CFG, model, opt, state, {"tokens_seen": 1})
    return root / "step-00000001"


def test_crafted_sharded_metadata_is_refused(tmp_path, marker):
    """torch.distributed.checkpoint unpickles `.metadata` without restriction; Kiln checks it first."""
    folder = _sharded_checkpoint(tmp_path / "ckpt")
    load_weights(folder)  # the genuine checkpoint passes the check
    (folder / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rewrite_manifest_checksums(folder)
    for load in (load_weights, CheckpointManager(tmp_path / "ckpt").load):
        with pytest.raises(CheckpointError, match=r"\.metadata: refers to builtins.exec.*refusing to unpickle"):
            load(folder)
    assert not marker.exists()


def _craft_sharded_entry(folder: Path, marker: Path, key: str | None = None) -> str:
    """Point a non-tensor entry of a sharded checkpoint at a payload (the first existing one, or a new
    `key`); returns the entry's key."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta_path = folder / "sharded" / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())  # Kiln's own file, just written
    if key is None:
        key = next(k for k, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata))
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    (folder / "sharded" / "extra.distcp").write_bytes(blob.getvalue())
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("extra.distcp", 0, len(blob.getvalue()))
    meta_path.write_bytes(pickle.dumps(metadata))
    _rewrite_manifest_checksums(folder, added=("sharded/extra.distcp",))
    return key


def test_crafted_sharded_entry_is_refused(tmp_path, marker):
    """A non-tensor entry (DCP's default planner unpickles those without restriction) pointing at a payload."""
    folder = _sharded_checkpoint(tmp_path / "ckpt")
    key = _craft_sharded_entry(folder, marker, "optim.param_groups.0.lr")
    with pytest.raises(CheckpointError, match=rf"extra.distcp: entry '{key}' is not plain data"):
        CheckpointManager(tmp_path / "ckpt").load(folder)
    assert not marker.exists()


def test_sharded_load_unpickles_entries_weights_only(tmp_path, marker):
    """Even past the up-front check, the load itself unpickles non-tensor entries with weights_only=True."""
    import warnings

    from kiln.checkpoint import load_sharded

    folder = _sharded_checkpoint(tmp_path / "ckpt")
    _craft_sharded_entry(folder, marker)
    model = build_model(CFG)
    opt, _ = _train_state(model)
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings(), pytest.raises(CheckpointException) as failed:
        warnings.simplefilter("ignore", UserWarning)
        load_sharded(folder, model, opt)
    ((error, _),) = failed.value.failures.values()  # rank 0's exception and its traceback
    assert isinstance(error, pickle.UnpicklingError) and "Unsupported global" in str(error)
    assert not marker.exists()


# ---- the code itself ----------------------------------------------------------------------------


def _unsafe_loads(path: Path) -> list[str]:
    """Calls in `path` that could unpickle untrusted data."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {k.arg: k.value for k in node.keywords}

        def constant(key):
            value = keywords.get(key)
            return value.value if isinstance(value, ast.Constant) else None

        bad = (
            name
            in (
                "pickle.load",
                "pickle.loads",
                "pickle.Unpickler",
                "joblib.load",
                "dill.load",
                "cloudpickle.load",
                "marshal.loads",
                "yaml.unsafe_load",
            )
            or (name == "torch.load" and constant("weights_only") is not True)
            or (name in ("np.load", "numpy.load") and constant("allow_pickle") is True)
            or (name == "yaml.load" and "Loader" not in keywords)
        )
        if bad:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    return found


def test_no_unrestricted_unpickling_in_kiln():
    """Every torch.load passes weights_only=True, np.load never allows pickles, and nothing calls
    pickle.load directly (the one unpickler, for DCP metadata, subclasses Unpickler with an allowlist)."""
    found = [hit for path in sorted((REPO / "kiln").rglob("*.py")) for hit in _unsafe_loads(path)]
    assert not found, found


# ---- server API keys ----------------------------------------------------------------------------


def test_server_compares_api_keys_in_constant_time(monkeypatch, kiln_tokenizer):
    from starlette.testclient import TestClient

    from kiln.serve.app import create_app

    tok = kiln_tokenizer
    model = build_model(ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=4, max_seq_len=32)).eval()
    keys = ["sk-first-key", "sk-second"]
    calls, verdict = [], {"force": None}
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b) if verdict["force"] is None else verdict["force"]

    monkeypatch.setattr(hmac, "compare_digest", spy)
    app = create_app(model, tok, model_name="m", api_keys=keys)
    with TestClient(app) as client:

        def status(key):
            calls.clear()
            return client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code

        assert status("sk-second") == 200
        # Every configured key is compared, through compare_digest, whichever matches.
        assert calls == [(b"sk-second", b"sk-first-key"), (b"sk-second", b"sk-second")]
        assert status("sk-wrong") == 401 and len(calls) == 2
        assert status("sk-first-key") == 200
        # The decision is compare_digest's: with it answering "no", even a right key is refused.
        verdict["force"] = False
        assert status("sk-first-key") == 401 and len(calls) == 2
