"""Disk full, read-only and permission errors: every writer publishes a file only when complete, and
the CLI reports a failed write as one line naming the path and the cause.

The failures are real where the kernel can give them without root (writes to /dev/full through a
symlink at the writer's temporary name, a folder without write permission when not root) and
injected where it cannot (a fake write that stops half-way and raises what the OS raises on a full
disk, or what torch and safetensors raise for it)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError

import kiln.files
from kiln.checkpoint import CheckpointManager, complete_checkpoints, save_weights, verify
from kiln.checkpoint.format import read_manifest
from kiln.cli import OS_ERROR_EXIT, main
from kiln.data.pack import write_shard
from kiln.files import os_error_line, publishing, write_failure, write_text_atomic
from kiln.model import ModelConfig, build_model

TORCH_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"
DEV_FULL = Path("/dev/full")
# Only the character device: were /dev/full missing, a write through the symlink would create it.
needs_dev_full = pytest.mark.skipif(
    not (DEV_FULL.exists() and stat.S_ISCHR(DEV_FULL.stat().st_mode)), reason="no /dev/full device here"
)
not_root = pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder without write permission")


def temporary_of(path: Path) -> Path:
    """The temporary name kiln.files.publishing writes `path` under in this process."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith(".tmp"))


def error_line(capsys) -> str:
    """The CLI's stderr, checked to be one `kiln: error:` line and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # The error follows what a progress bar left on its line; from there on it is one line.
    assert err.count("kiln: error:") == 1, err
    line = err[err.index("kiln: error:") :]
    assert line.endswith("\n") and "\n" not in line[:-1], err
    return line[:-1]


# ---- the translation of a failed write -----------------------------------------------------------


def test_failed_writes_become_os_errors_naming_the_destination(tmp_path, monkeypatch):
    dest = tmp_path / "model.safetensors"
    tmp = temporary_of(dest)
    plain = write_failure(OSError(errno.ENOSPC, "No space left on device"), dest)
    assert (plain.errno, plain.filename) == (errno.ENOSPC, str(dest))
    renamed = write_failure(PermissionError(errno.EACCES, "Permission denied", str(tmp)), dest, tmp)
    assert isinstance(renamed, PermissionError) and renamed.filename == str(dest)
    other = FileNotFoundError(errno.ENOENT, "No such file or directory", "/elsewhere/source")
    assert write_failure(other, dest) is other  # the OS named another file: keep it
    assert write_failure(SafetensorError(SAFETENSORS_FULL), dest).errno == errno.ENOSPC
    assert write_failure(ValueError("not a write"), dest) is None
    assert write_failure(RuntimeError("shape mismatch"), dest) is None

    # torch's short write has no errno: the free space on the destination's disk decides.
    monkeypatch.setattr(kiln.files, "free_bytes", lambda path: 0)
    assert write_failure(RuntimeError(TORCH_SHORT_WRITE), dest).errno == errno.ENOSPC
    assert write_failure(OSError("100000 requested and 0 written"), dest).errno == errno.ENOSPC  # numpy
    monkeypatch.setattr(kiln.files, "free_bytes", lambda path: 10 << 30)
    stopped = write_failure(RuntimeError(TORCH_SHORT_WRITE), dest)
    assert stopped.errno == errno.EIO and "10240 MiB free" in os_error_line(stopped)


@pytest.mark.parametrize(
    "code, cause",
    [
        (errno.ENOSPC, "disk full"),
        (errno.EROFS, "read-only file system"),
        (errno.EACCES, "permission denied"),
        (errno.EPERM, "permission denied"),
        (errno.EDQUOT, "disk quota exceeded"),
        (errno.ENOENT, "not found"),
    ],
)
def test_os_error_line_names_path_and_cause(code, cause):
    assert os_error_line(OSError(code, os.strerror(code), "/runs/x/a.bin")) == f"/runs/x/a.bin: {cause}"
    assert os_error_line(OSError(code, os.strerror(code), "/a", None, "/b")) == f"/a -> /b: {cause}"


@needs_dev_full
def test_a_full_disk_publishes_nothing_and_keeps_the_previous_file(tmp_path):
    """The kernel's ENOSPC (writes to /dev/full): the destination keeps its previous content and the
    temporary is gone, for text, numpy shards and torch.save."""
    dest = tmp_path / "stats.json"
    dest.write_text("previous")
    temporary_of(dest).symlink_to(DEV_FULL)
    with pytest.raises(OSError) as raised:
        write_text_atomic(dest, "new" * 10_000)
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(dest))
    assert dest.read_text() == "previous" and leftovers(tmp_path) == []

    shard = tmp_path / "train" / "web-00000.bin"
    shard.parent.mkdir()
    temporary_of(shard).symlink_to(DEV_FULL)
    header = {"dtype": "uint16", "vocab_size": 64, "tokenizer_sha256": "x", "documents": 1, "bytes": 1}
    with pytest.raises(OSError) as raised:
        write_shard(shard, np.arange(100_000) % 64, header)
    assert "disk full" in os_error_line(raised.value) and raised.value.filename == str(shard)
    assert sorted(p.name for p in shard.parent.iterdir()) == []

    state = tmp_path / "train_state.pt"
    temporary_of(state).symlink_to(DEV_FULL)
    with pytest.raises(OSError) as raised:
        with publishing(state) as tmp:
            torch.save({"x": torch.zeros(100_000)}, tmp)
    assert raised.value.filename == str(state) and not state.exists() and leftovers(tmp_path) == []


@not_root
def test_a_read_only_folder_is_permission_denied_naming_the_file(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text("previous")
    folder.chmod(0o555)
    try:
        with pytest.raises(OSError) as raised:
            write_text_atomic(folder / "config.json", "{}")
    finally:
        folder.chmod(0o755)
    assert os_error_line(raised.value) == f"{folder / 'config.json'}: permission denied"
    assert (folder / "config.json").read_text() == "previous"


# ---- through the CLI -----------------------------------------------------------------------------


# A pretraining run of six steps that saves every second step and logs every step.
PRETRAIN = (
    "model.dim=32 model.n_layers=1 model.n_heads=4 model.max_seq_len=16 train.seq_len=16 "
    "train.micro_batch_size=2 train.global_batch_tokens=64 train.max_steps=6 train.warmup_steps=2 "
    "train.precision=fp32 train.compile=false train.eval_every=100 train.log_every=1 train.ckpt_every=2 "
    "train.peak_flops=1e12"
).split()


def pretrain_args(tmp_path, tiny_pack_factory) -> tuple[list[str], Path]:
    """`kiln pretrain` arguments for a run on a tiny pack, and the stage folder it writes."""
    tiny_pack_factory(tmp_path / "run" / "pack")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[run]\nname = "run"\nout_dir = "{tmp_path}"\nstages = ["pretrain"]\n')
    return ["pretrain", str(recipe), *PRETRAIN], tmp_path / "run" / "pretrain"


def test_checkpoint_save_on_a_full_disk(tmp_path, tiny_pack_factory, monkeypatch, capsys):
    """The step-4 save stops half-way through train_state.pt with torch's own error: one line naming
    the file and "disk full", exit 3, no step-4 folder or temporary, step 2 intact and `latest`."""
    args, stage = pretrain_args(tmp_path, tiny_pack_factory)
    real_save, saves = torch.save, []

    def save(obj, f, *args, **kwargs):
        if Path(str(f)).name.startswith(".train_state.pt"):
            saves.append(f)
            if len(saves) == 2:
                Path(f).write_bytes(b"PK" * 100)  # the part that reached the disk
                raise RuntimeError(TORCH_SHORT_WRITE)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(kiln.files, "free_bytes", lambda path: 4096)  # what a full disk has left
    assert main(args) == OS_ERROR_EXIT
    root = stage / "checkpoints"
    line = error_line(capsys)
    assert line == f"kiln: error: {root / '.tmp-step-00000004' / 'train_state.pt'}: disk full"
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000002"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002"]
    assert (root / "latest").read_text().strip() == "step-00000002"
    verify(root / "step-00000002", read_manifest(root / "step-00000002"))


def test_background_save_on_a_full_disk_is_raised_by_finish(tmp_path, monkeypatch):
    """parallel.async_checkpoint: the writer thread's failure reaches the training thread at finish()
    as the OSError naming the file, and the half-written folder is gone."""
    import kiln.checkpoint.format as checkpoint_format

    def full_save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)
        raise SafetensorError(SAFETENSORS_FULL)

    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=8)
    root, state = tmp_path / "ckpt", build_model(cfg).state_dict()
    manager = CheckpointManager(root, background=True)
    manager.save(1, cfg, state, {}, {})
    manager.finish()
    monkeypatch.setattr(checkpoint_format, "save_file", full_save_file)
    manager.save(2, cfg, state, {}, {})
    with pytest.raises(OSError) as raised:
        manager.finish()
    assert os_error_line(raised.value) == f"{root / '.tmp-step-00000002' / 'model.safetensors'}: disk full"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001"]


def test_metrics_on_a_full_disk_keep_whole_lines(tmp_path, tiny_pack_factory, monkeypatch, capsys):
    """The third record of metrics.jsonl gets half-way to the disk: exit 3, one line naming the log,
    and the log holds the two records before it, whole."""
    import kiln.train.metrics as metrics

    args, stage = pretrain_args(tmp_path, tiny_pack_factory)

    class FillingFile:
        def __init__(self, real):
            self.real, self.writes = real, 0

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                self.real.write(bytes(data[: len(data) // 2]))
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.real.write(data)

        def __getattr__(self, name):
            return getattr(self.real, name)

    def filling_open(path, mode="r", *args, **kwargs):
        real = open(path, mode, *args, **kwargs)
        return FillingFile(real) if Path(path).name == "metrics.jsonl" and "a" in mode else real

    monkeypatch.setattr(metrics, "open", filling_open, raising=False)
    assert main(args) == OS_ERROR_EXIT
    log = stage / "metrics.jsonl"
    assert error_line(capsys) == f"kiln: error: {log}: disk full"
    text = log.read_text()
    assert text.endswith("\n") and len(text.splitlines()) == 2
    assert all(isinstance(json.loads(line), dict) for line in text.splitlines())


def write_corpus(folder: Path, n: int = 60) -> None:
    folder.mkdir(parents=True)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    records = [
        {"id": f"web/{i}", "text": " ".join(words[(i + j) % 10] for j in range(40)), "source": "web", "meta": {}}
        for i in range(n)
    ]
    (folder / "docs-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_pack_on_a_full_disk(tmp_path, kiln_tokenizer, monkeypatch, capsys):
    """mixture.json stops half-way: exit 3, one line naming it, no mixture.json, no temporary, no DONE
    marker; every shard that was published has its header; the corpus and tokenizer are untouched."""
    run_dir = tmp_path / "run"
    write_corpus(run_dir / "corpus")
    (run_dir / "tokenizer").mkdir()
    shutil.copyfile(kiln_tokenizer.path, run_dir / "tokenizer" / "tokenizer.json")
    before = {p: p.read_bytes() for p in [*run_dir.rglob("*.jsonl"), run_dir / "tokenizer" / "tokenizer.json"]}
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[run]\nname = "run"\nout_dir = "{tmp_path}"\nstages = ["pack"]\n[pack]\nshard_tokens = 500\n')
    real_write_text = Path.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name.startswith(".mixture.json"):
            real_write_text(self, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    assert main(["pack", str(recipe)]) == OS_ERROR_EXIT
    out = run_dir / "pack"
    assert error_line(capsys) == f"kiln: error: {out / 'mixture.json'}: disk full"
    assert not (out / "mixture.json").exists() and not (out / "DONE").exists() and leftovers(out) == []
    shards = sorted(out.glob("*/*.bin"))
    assert len(shards) > 1 and all(p.with_suffix(".json").is_file() for p in shards)
    assert {p: p.read_bytes() for p in before} == before

    monkeypatch.undo()  # space freed: the rerun builds the whole stage
    assert main(["pack", str(recipe)]) == 0
    assert json.loads((out / "mixture.json").read_text())["weights"] == {"web": 1.0}


def exported_checkpoint(tmp_path, kiln_tokenizer) -> Path:
    cfg = ModelConfig(vocab_size=kiln_tokenizer.vocab_size, dim=32, n_layers=1, n_heads=4, max_seq_len=32)
    ckpt = save_weights(tmp_path / "ckpt", cfg, build_model(cfg).state_dict(), {"step": 1})
    shutil.copyfile(kiln_tokenizer.path, ckpt / "tokenizer.json")
    return ckpt


def test_export_hf_on_a_full_disk_keeps_the_earlier_export(tmp_path, kiln_tokenizer, monkeypatch, capsys):
    """A second export whose model.safetensors fails as safetensors reports a full disk: exit 3, one
    line naming the file, the first export's files unchanged and no temporary."""
    ckpt, out = exported_checkpoint(tmp_path, kiln_tokenizer), tmp_path / "hf"
    assert main(["export", "hf", str(ckpt), str(out)]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(first)

    def full_save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)
        raise SafetensorError(SAFETENSORS_FULL)

    monkeypatch.setattr("kiln.checkpoint.format.save_file", full_save_file)
    assert main(["export", "hf", str(ckpt), str(out)]) == OS_ERROR_EXIT
    assert error_line(capsys) == f"kiln: error: {out / 'model.safetensors'}: disk full"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first


@needs_dev_full
def test_export_hf_config_to_dev_full(tmp_path, kiln_tokenizer, capsys):
    """The kernel's ENOSPC on config.json, written last: no config.json is published, so the folder
    never looks like a loadable model."""
    ckpt, out = exported_checkpoint(tmp_path, kiln_tokenizer), tmp_path / "hf"
    out.mkdir()
    temporary_of(out / "config.json").symlink_to(DEV_FULL)
    assert main(["export", "hf", str(ckpt), str(out)]) == OS_ERROR_EXIT
    assert error_line(capsys) == f"kiln: error: {out / 'config.json'}: disk full"
    assert not (out / "config.json").exists() and leftovers(out) == []


@not_root
def test_export_hf_into_a_read_only_folder(tmp_path, kiln_tokenizer, capsys):
    ckpt, out = exported_checkpoint(tmp_path, kiln_tokenizer), tmp_path / "hf"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert main(["export", "hf", str(ckpt), str(out)]) == OS_ERROR_EXIT
    finally:
        out.chmod(0o755)
    assert error_line(capsys) == f"kiln: error: {out / 'tokenizer.json'}: permission denied"
    assert list(out.iterdir()) == []
