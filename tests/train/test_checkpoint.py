import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from kiln_testing.recipes import pretrain_only_recipe

from kiln.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    complete_checkpoints,
    resolve_checkpoint,
    restore_rng_state,
    save_weights,
)
from kiln.checkpoint.format import _manifest_digest
from kiln.errors import ConfigError
from kiln.model import ModelConfig, build_model
from kiln.model.weights import load_weights, upgrade_layout
from kiln.train.config import TrainConfig
from kiln.train.optim import build_optimizer
from kiln.train.trainer_state import Checkpointing

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def _model(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    return build_model(cfg)


def _train_state(model):
    opt = build_optimizer(model, TrainConfig())
    model(torch.randint(0, 64, (2, 8))).float().mean().backward()
    opt.step()
    scaler = torch.amp.GradScaler("cpu")
    return {"optimizer": opt.state_dict(), "scaler": scaler.state_dict(), "loop": {"step": 1, "best": float("inf")}}


def _save(manager, step, model, is_best=False):
    return manager.save(step, CFG, model.state_dict(), _train_state(model), {"tokens_seen": step * 10}, is_best=is_best)


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_weights_roundtrip(tmp_path, tied):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=tied)
    model = _model(cfg=cfg)
    save_weights(tmp_path / "w", cfg, model.state_dict(), {"note": "x"})
    loaded_cfg, state, manifest = load_weights(tmp_path / "w")
    assert loaded_cfg == cfg and manifest["note"] == "x"
    _assert_same(state, model.state_dict())
    manifest_file = json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert set(manifest_file["files"]) == {"model.safetensors"}


def test_shared_tensors_are_stored_once(tmp_path):
    weight = torch.randn(4, 4)
    save_weights(tmp_path / "w", CFG, {"a": weight, "b": weight})
    _, state, manifest = load_weights(tmp_path / "w")
    assert manifest["tied"] == {"b": "a"} and torch.equal(state["b"], weight)


def test_load_weights_resolves_root_and_stage_folder(tmp_path):
    manager = CheckpointManager(tmp_path / "pretrain" / "checkpoints", keep_last=3)
    _save(manager, 1, _model(1))
    newest = _model(2)
    _save(manager, 2, newest)
    for path in (
        tmp_path / "pretrain",
        tmp_path / "pretrain" / "checkpoints",
        tmp_path / "pretrain" / "checkpoints" / "step-00000002",
    ):
        assert resolve_checkpoint(path).name == "step-00000002"
        _, state, manifest = load_weights(path)
        assert manifest["step"] == 2 and manifest["tokens_seen"] == 20
        _assert_same(state, newest.state_dict())
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_weights(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        load_weights(tmp_path)


def test_layout_latest_and_train_state(tmp_path):
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root)
    model = _model()
    folder = _save(manager, 7, model)
    assert folder == root / "step-00000007"
    assert (root / "latest").read_text().strip() == "step-00000007"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "model.safetensors", "train_state.pt"]
    manifest, model_state, train_state = manager.load(folder)
    assert manifest["step"] == 7 and manifest["model_config"]["dim"] == 32
    _assert_same(model_state, model.state_dict())
    assert train_state["loop"] == {"step": 1, "best": float("inf")}
    assert train_state["scaler"]["scale"] == 65536.0
    # Loads into a fresh optimizer.
    build_optimizer(_model(), TrainConfig()).load_state_dict(train_state["optimizer"])


def test_leftover_tmp_folder_is_ignored_and_cleaned(tmp_path):
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep_last=5)
    _save(manager, 1, _model())
    crashed = root / ".tmp-step-00000002"
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"partial")
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000001"]
    folder, manifest, _, _ = manager.load_newest_valid()
    assert folder.name == "step-00000001" and manifest["step"] == 1
    _save(manager, 3, _model())
    assert not crashed.exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corruption_detected_and_fallback(tmp_path, damage):
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep_last=3)
    older = _model(1)
    _save(manager, 1, older)
    _save(manager, 2, _model(2))
    target = root / "step-00000002" / ("model.safetensors" if damage == "flip" else "train_state.pt")
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        target.write_bytes(bytes(data[: len(data) // 2]))
    expected = "corrupted" if damage == "flip" else "truncated"
    with pytest.raises(CheckpointError, match=f"{target.name}.*{expected}"):
        manager.load(root / "step-00000002")
    with pytest.warns(UserWarning, match="skipping checkpoint step-00000002"):
        folder, manifest, model_state, _ = manager.load_newest_valid()
    assert folder.name == "step-00000001"
    _assert_same(model_state, older.state_dict())
    if damage == "flip":
        with pytest.raises(CheckpointError, match="model.safetensors"):
            load_weights(root / "step-00000002")


def test_corrupted_manifest_is_named(tmp_path):
    manager = CheckpointManager(tmp_path)
    folder = _save(manager, 1, _model())
    (folder / "manifest.json").write_text('{"step": 1, "mod')
    with pytest.raises(CheckpointError, match="manifest.json: corrupted manifest"):
        manager.load(folder)
    with pytest.warns(UserWarning):
        assert manager.load_newest_valid() is None


def test_a_checkpoint_from_a_newer_kiln_is_skipped_on_resume(tmp_path):
    """The trainer's manager converts states through kiln.model.weights.upgrade_layout, which reads
    the manifest's model config first: unknown keys (a newer Kiln's) refuse that checkpoint, and
    resume falls back to the one before."""
    manager = CheckpointManager(tmp_path, keep_last=3, convert_state=upgrade_layout)
    _save(manager, 1, _model(1))
    newer = _save(manager, 2, _model(2))
    manifest = json.loads((newer / "manifest.json").read_text())
    manifest["model_config"]["sliding_window"] = 4096
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (newer / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"unknown keys \['sliding_window'\]"):
        manager.load(newer)
    CheckpointManager(tmp_path).load(newer)  # the format alone does not know model configs
    with pytest.warns(UserWarning, match="skipping checkpoint step-00000002"):
        assert manager.load_newest_valid()[0].name == "step-00000001"


def test_keep_last_and_best_retention(tmp_path):
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep_last=2, keep_best=True)
    model = _model()
    for step in range(1, 7):
        _save(manager, step, model, is_best=step in (1, 2))
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000002", "step-00000005", "step-00000006"]
    assert (root / "best").read_text().strip() == "step-00000002"
    assert (root / "latest").read_text().strip() == "step-00000006"
    assert not [p for p in root.iterdir() if p.name.startswith(".")]

    no_best = CheckpointManager(tmp_path / "nb", keep_last=1, keep_best=False)
    for step in range(1, 4):
        _save(no_best, step, model, is_best=step == 1)
    assert [p.name for p in complete_checkpoints(tmp_path / "nb")] == ["step-00000003"]
    assert not (tmp_path / "nb" / "best").exists()


def test_weights_only_checkpoint_cannot_be_resumed(tmp_path):
    save_weights(tmp_path / "step-00000000", CFG, _model().state_dict())
    with pytest.raises(CheckpointError, match="weights-only"):
        CheckpointManager(tmp_path).load(tmp_path / "step-00000000")


def test_rng_state_roundtrip_through_json():
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    state = json.loads(json.dumps(capture_rng_state()))
    expected = (torch.rand(5), np.random.rand(5), np.random.normal(), [random.random() for _ in range(5)])
    torch.manual_seed(99)
    np.random.seed(99)
    random.seed(99)
    restore_rng_state(state)
    got = (torch.rand(5), np.random.rand(5), np.random.normal(), [random.random() for _ in range(5)])
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1])
    assert expected[2] == got[2] and expected[3] == got[3]


def test_rewind_sets_aside_newer_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep_last=5)
    model = _model()
    for step in (1, 2, 3):
        _save(manager, step, model, is_best=step in (1, 3))
    with pytest.warns(UserWarning, match="step-00000003 is newer than the resumed step 2"):
        manager.rewind(2, best_step=1)
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000001", "step-00000002"]
    assert (root / "abandoned-step-00000003" / "manifest.json").is_file()
    assert manager.latest_name == "step-00000002" and manager.best_name == "step-00000001"
    assert resolve_checkpoint(root, pointer="latest").name == "step-00000002"
    assert resolve_checkpoint(root).name == "step-00000001"  # a loading verb takes `best`


def test_stale_latest_pointer_falls_back_to_newest_complete(tmp_path):
    """`latest` naming a folder that is gone (a kill between rewind's renames and the pointer write)
    resolves to the newest complete checkpoint, with a warning; with none left it is an error."""
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep_last=5)
    for step in (1, 2):
        _save(manager, step, _model(step))
    (root / "latest").write_text("step-00000003\n")
    with pytest.warns(
        UserWarning,
        match="names 'step-00000003', which is not a complete checkpoint; using the newest complete one, step-00000002",
    ):
        assert resolve_checkpoint(root).name == "step-00000002"
    for step in (1, 2):
        (root / f"step-{step:08d}" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="latest: names 'step-00000003'"):
        resolve_checkpoint(root)


def _fuse_gate_up(gate, up, layout):
    # Layout 1 stacked SwiGLU's gate rows over its up rows in one w13; layout 2 interleaved them.
    return torch.cat([gate, up], dim=-2) if layout == 1 else torch.stack([gate, up], dim=-2).flatten(-3, -2)


def _old_layout_checkpoint(folder, cfg, model, layout):
    """`model`'s weights saved as a Kiln of weights layout `layout` wrote them."""
    from kiln.model.transformer import split_qkv

    old = {}
    state = model.state_dict()
    for name, t in state.items():
        if name.endswith("attn.wqkv.weight") and layout == 1:
            t = torch.cat(split_qkv(t, cfg.n_heads, cfg.kv_heads, cfg.head_dim))
        if name.endswith(("w3", "w3.weight")) and name.rsplit(".", 2)[-2:] != ["attn", "w3"]:
            continue
        if name.endswith(("w1", "w1.weight")) and "ffn" in name:
            up = state[name.replace("w1", "w3")]
            name, t = name.replace("w1", "w13"), _fuse_gate_up(t, up, layout)
        old[name] = t
    folder = save_weights(folder, cfg, old)
    manifest = json.loads((folder / "manifest.json").read_text())
    if layout == 1:  # such a manifest (format 1) had no weights_layout, and no self-checksum either
        del manifest["weights_layout"], manifest["manifest_sha256"]
        manifest["format"] = 1
        (folder / "manifest.json").write_text(json.dumps(manifest))
    else:
        _rewrite_manifest(folder, {**manifest, "weights_layout": layout})
    return folder


def _rewrite_manifest(folder, manifest):
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("layout", [1, 2])
@pytest.mark.parametrize("moe", [False, True])
def test_checkpoint_saved_in_an_old_fused_layout_is_converted_on_load(tmp_path, layout, moe):
    """Layout 1: wqkv [q; k; v] and w13 [gate; up]; layout 2: wqkv grouped by kv head and w13's gate
    and up rows interleaved (dense FFN, shared expert and routed experts). Either must still compute
    what it computed when saved, now with w1 and w3."""
    extra = {"moe_every": 1, "n_experts": 4, "moe_top_k": 2, "moe_shared_expert": True} if moe else {}
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, **extra)
    model = build_model(cfg)
    folder = _old_layout_checkpoint(tmp_path / "old", cfg, model, layout)
    _, state, _ = load_weights(folder)
    assert set(state) == set(model.state_dict())
    for name, t in model.state_dict().items():
        assert torch.equal(state[name], t), name


def test_a_run_saved_in_an_old_layout_is_refused_on_resume_with_a_pointer_to_init_from(tmp_path):
    # Its weights convert (the test above); its optimizer moments, one per old parameter, do not.
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep_last=3, convert_state=upgrade_layout)
    model = build_model(cfg)
    folder = manager.save(1, cfg, model.state_dict(), _train_state(model), {"tokens_seen": 1, "loader": {}})
    _rewrite_manifest(folder, {**json.loads((folder / "manifest.json").read_text()), "weights_layout": 2})

    probe = Checkpointing()
    probe.ckpt, probe.is_main, probe.model_cfg = manager, True, cfg
    with pytest.raises(ConfigError, match=r"weights layout 2 .*--init-from "):
        probe._find_checkpoint(str(folder))


def test_manifest_damage_that_keeps_valid_json_is_detected(tmp_path):
    """A flipped digit in the loader position still parses; the manifest's own checksum catches it."""
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep_last=3)
    _save(manager, 1, _model(1))
    folder = manager.save(
        2, CFG, _model(2).state_dict(), _train_state(_model(2)), {"tokens_seen": 20, "loader": {"position": 12345}}
    )
    text = (folder / "manifest.json").read_text()
    assert '"position": 12345' in text
    (folder / "manifest.json").write_text(text.replace('"position": 12345', '"position": 12845'))
    with pytest.raises(CheckpointError, match="manifest.json: content does not match its manifest_sha256"):
        manager.load(folder)
    with pytest.raises(CheckpointError, match="corrupted manifest"):
        load_weights(folder)
    with pytest.warns(UserWarning, match="skipping checkpoint step-00000002"):
        assert manager.load_newest_valid()[0].name == "step-00000001"


# ---- sharded (torch.distributed.checkpoint) checkpoints ----------------------------------------


def _save_sharded(manager, step, seed):
    from kiln.checkpoint import ShardedSaver

    model = _model(seed)
    opt = build_optimizer(model, TrainConfig())
    model(torch.randint(0, 64, (2, 8))).float().mean().backward()
    opt.step()
    with warnings.catch_warnings():  # DCP in one process without a process group: intended here
        warnings.simplefilter("ignore", UserWarning)
        ShardedSaver(manager).save(step, CFG, model, opt, {"scaler": {}, "loop": {"step": step}}, {"tokens_seen": step})
    return model


@pytest.mark.parametrize(
    "target, damage, expected",
    [
        ("sharded/__0_0.distcp", "flip", "corrupted"),
        ("sharded/.metadata", "truncate", "truncated"),
        ("train_state.pt", "flip", "corrupted"),
    ],
)
def test_sharded_checkpoint_corruption_detected_and_fallback(tmp_path, target, damage, expected):
    root = tmp_path / "ckpt"
    manager = CheckpointManager(root, keep_last=3)
    older = _save_sharded(manager, 1, 1)
    _save_sharded(manager, 2, 2)
    folder = root / "step-00000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["layout"] == "sharded" and target in manifest["files"]  # every shard is checksummed
    path = folder / target
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 3] ^= 0x10
    else:
        del data[len(data) // 2 :]
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path}: .*{expected}"):
        manager.load(folder)
    with pytest.raises(CheckpointError, match=Path(target).name):
        load_weights(folder)
    with pytest.warns(UserWarning, match=f"skipping checkpoint step-00000002: {path}"):
        found, manifest, model_state, train_state = manager.load_newest_valid()
    assert found.name == "step-00000001" and model_state is None and train_state["loop"] == {"step": 1}
    _, weights, _ = load_weights(found)
    _assert_same(weights, older.state_dict())


# ---- through `kiln pretrain` -------------------------------------------------------------------


def test_pretrain_cli_resumes_from_newest_complete_checkpoint(tmp_path, tiny_pack_factory, capsys):
    """`kiln pretrain` (resume=auto by default) after a crash that left the step-8 save unfinished
    and the step-6 weights damaged: it warns, resumes from step 4, and ends where the first run did.
    An explicit --resume of the damaged checkpoint is an error naming the file."""
    from kiln.cli import main

    recipe, stage = pretrain_only_recipe(tmp_path, tiny_pack_factory)
    assert main(["pretrain", str(recipe)]) == 0
    root = stage / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == [f"step-{s:08d}" for s in (2, 4, 6, 8)]
    _, final, _ = load_weights(root / "step-00000008")
    final = {k: v.clone() for k, v in final.items()}  # the files below change under the mapping
    # The crash: the stage is not done, the last save never got its manifest or its rename, and a
    # bit of the step-6 weights flipped.
    (stage / "DONE").unlink()
    (root / "step-00000008" / "manifest.json").unlink()
    (root / "step-00000008").rename(root / ".tmp-step-00000008")
    damaged = root / "step-00000006" / "model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-7] ^= 0x01
    damaged.write_bytes(bytes(data))
    capsys.readouterr()

    assert main(["pretrain", str(recipe), "--resume", str(root / "step-00000006")]) == 2
    err = capsys.readouterr().err
    assert f"{damaged}: sha256 does not match the manifest (corrupted file)" in err and "Traceback" not in err

    with pytest.warns(UserWarning) as warned:
        assert main(["pretrain", str(recipe)]) == 0
    messages = " ".join(str(w.message) for w in warned)
    assert f"skipping checkpoint step-00000006: {damaged}" in messages
    summary = json.loads((stage / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-00000004") and summary["steps"] == 8
    assert not (root / ".tmp-step-00000008").exists()
    _, redone, _ = load_weights(stage)
    _assert_same(redone, final)
    steps = [
        r["step"] for r in map(json.loads, (stage / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"
    ]
    assert steps == sorted(set(steps)) and steps[-1] == 8
