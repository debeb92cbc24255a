"""Nothing a run made is lost: extending a finished pretraining continues it, damaged checkpoints are
set aside (never pruned into, never named by latest/DONE/summary.json), and manifests that parse
but hold the wrong types, or lost their checksum, are refused by file and field."""

import json
import re

import pytest
import torch
from kiln_testing.recipes import pretrain_only_recipe

from kiln.checkpoint import CheckpointError, CheckpointManager, complete_checkpoints, read_manifest, step_dirname
from kiln.checkpoint.format import _manifest_digest
from kiln.cli import main
from kiln.model import ModelConfig, build_model
from kiln.model.weights import load_weights

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def _train_steps(stage) -> list[int]:
    lines = (stage / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_extending_a_finished_pretrain_resumes_from_its_last_checkpoint(tmp_path, tiny_pack_factory, capsys):
    recipe, stage = pretrain_only_recipe(tmp_path, tiny_pack_factory)
    assert main(["pretrain", str(recipe), "train.log_every=1"]) == 0
    first_log = _train_steps(stage)
    assert first_log == list(range(1, 9))
    capsys.readouterr()
    assert main(["pretrain", str(recipe), "train.log_every=1", "train.max_steps=12"]) == 0
    out = capsys.readouterr().out
    assert "[pretrain] extending the run: train.max_steps: 8 -> 12; resuming from its newest checkpoint" in out
    assert "cosine schedule now spans 12 steps: step 8 trains at lr" in out
    summary = json.loads((stage / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["resumed_from"].endswith(step_dirname(8))
    assert _train_steps(stage) == list(range(1, 13))  # the first 8 steps' log is kept, not redone
    assert not list(tmp_path.glob("run/pretrain.previous*"))
    done = json.loads((stage / "DONE").read_text())
    assert done["inputs"]["train"]["max_steps"] == 12 and done["stats"]["steps"] == 12
    assert json.loads((stage / "extensions.jsonl").read_text())["stats"]["steps"] == 8


def test_resume_with_every_checkpoint_damaged_keeps_them_and_the_old_log(tmp_path, tiny_pack_factory):
    """keep_last=2: step-6 and step-8 survive the first run. Both damaged, the restart trains from
    step 0; before the fix it pruned each new save the moment it was published (the two damaged
    ones were newer) and truncated metrics.jsonl."""
    recipe, stage = pretrain_only_recipe(tmp_path, tiny_pack_factory)
    assert main(["pretrain", str(recipe), "train.keep_last=2", "train.log_every=1"]) == 0
    root = stage / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == [step_dirname(6), step_dirname(8)]
    old_log = (stage / "metrics.jsonl").read_text()
    (stage / "DONE").unlink()
    for step in (6, 8):
        weights = root / step_dirname(step) / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0x01
        weights.write_bytes(bytes(data))

    with pytest.warns(UserWarning) as warned:
        assert main(["pretrain", str(recipe), "train.keep_last=2", "train.log_every=1"]) == 0
    for step in (8, 6):
        assert any(f"moved to damaged/{step_dirname(step)}; falling back" in str(w.message) for w in warned)
    assert sorted(p.name for p in (root / "damaged").iterdir()) == [step_dirname(6), step_dirname(8)]
    assert [p.name for p in complete_checkpoints(root)] == [step_dirname(6), step_dirname(8)]
    for name in ("latest", "best"):
        assert (root / (root / name).read_text().strip() / "manifest.json").is_file()
    summary = json.loads((stage / "summary.json").read_text())
    assert summary["resumed_from"] is None and summary["checkpoint"] == str(root / step_dirname(8))
    assert json.loads((stage / "DONE").read_text())["stats"]["checkpoint"] == summary["checkpoint"]
    load_weights(root / step_dirname(8))  # the new checkpoint verifies
    assert (stage / "metrics.previous-1.jsonl").read_text() == old_log
    assert _train_steps(stage) == list(range(1, 9))


def _save(manager, step, position=0):
    torch.manual_seed(step)
    model = build_model(CFG)
    train_state = {"optimizer": {}, "scaler": {}, "loop": {"step": step}}
    return manager.save(step, CFG, model.state_dict(), train_state, {"loader": {"position": position}})


def _rewrite(folder, edit, checksum=True):
    manifest = json.loads((folder / "manifest.json").read_text())
    edit(manifest)
    if checksum:
        manifest["manifest_sha256"] = _manifest_digest(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.update(model_config=1, files=2), "field 'model_config' must be an object, got 1"),
        (lambda m: m.update(files=2), "field 'files' must be an object of file name -> {sha256, bytes}, got 2"),
        (
            lambda m: m["files"]["model.safetensors"].update(bytes="12"),
            "field files['model.safetensors'].bytes must be",
        ),
        (lambda m: m["files"]["model.safetensors"].update(sha256=7), "field files['model.safetensors'].sha256 must be"),
        (lambda m: m.update(step="5"), "field 'step' must be an integer >= 0, got '5'"),
        (lambda m: m.update(loader=[3]), "field 'loader' must be an object, got [3]"),
        (lambda m: m.update(format=99), "field 'format' is 99, newer than this Kiln reads"),
    ],
)
def test_manifest_with_wrong_types_is_a_named_error_and_resume_falls_back(tmp_path, edit, message):
    manager = CheckpointManager(tmp_path, keep_last=3)
    _save(manager, 1)
    newer = _save(manager, 2)
    _rewrite(newer, edit)
    with pytest.raises(CheckpointError, match="manifest.json: " + re.escape(message)):
        manager.load(newer)
    with pytest.warns(UserWarning, match="skipping checkpoint step-00000002"):
        assert manager.load_newest_valid(quarantine=True)[0].name == "step-00000001"
    assert (tmp_path / "damaged" / "step-00000002").is_dir() and manager.latest_name == "step-00000001"


def test_a_deleted_manifest_checksum_is_refused_unless_the_format_predates_it(tmp_path):
    """An edited loader position with manifest_sha256 deleted used to resume unnoticed."""
    manager = CheckpointManager(tmp_path, keep_last=3)
    _save(manager, 1, position=100)
    newer = _save(manager, 2, position=200)
    _rewrite(newer, lambda m: (m["loader"].update(position=999), m.pop("manifest_sha256")), checksum=False)
    with pytest.raises(CheckpointError, match="field 'manifest_sha256' is missing, which a format 2 manifest"):
        manager.load(newer)
    with pytest.warns(UserWarning, match="skipping checkpoint step-00000002"):
        assert manager.load_newest_valid()[1]["loader"] == {"position": 100}
    _rewrite(newer, lambda m: m.update(format=1), checksum=False)  # written before the checksum existed
    assert read_manifest(newer)["loader"] == {"position": 999}


def test_pruning_never_deletes_the_checkpoint_it_just_published(tmp_path):
    """A root that still holds a newer step folder (here step 10, left by another run): keep_last=1
    would otherwise delete step 2 the moment `latest` names it."""
    other = CheckpointManager(tmp_path, keep_last=1)
    _save(other, 10)
    (tmp_path / "latest").unlink()
    manager = CheckpointManager(tmp_path, keep_last=1, keep_best=False)
    folder = _save(manager, 2)
    assert (folder / "manifest.json").is_file() and manager.latest_name == folder.name
