"""Checkpoints on S3 (a moto server on 127.0.0.1): manifest-last publish, killed uploads, resume."""

import json
import warnings

import pytest
import torch
from kiln_testing.train import tiny_train_config

from kiln import storage
from kiln.checkpoint import (
    CheckpointError,
    RemoteCheckpointManager,
    checkpoint_manager,
    complete_checkpoints,
    resolve_checkpoint,
)
from kiln.model import ModelConfig, build_model
from kiln.model.weights import load_weights
from kiln.train.trainer import Trainer

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _model(seed):
    torch.manual_seed(seed)
    return build_model(CFG)


def _train_state(step):
    return {"optimizer": {}, "scaler": {}, "loop": {"step": step}}


def _save(manager, step, model, **kw):
    return manager.save(step, CFG, model.state_dict(), _train_state(step), {"tokens_seen": step}, **kw)


def test_save_list_load_roundtrip(s3_bucket, cache):
    root = f"{s3_bucket}/run/checkpoints"
    manager = checkpoint_manager(root, keep_last=2)
    assert isinstance(manager, RemoteCheckpointManager)
    models = {step: _model(step) for step in (1, 2, 3)}
    for step, model in models.items():
        assert _save(manager, step, model, is_best=step == 1) == f"{root}/step-{step:08d}"
    # keep_last=2 and the best (step 1) are kept; nothing else.
    assert complete_checkpoints(root) == [f"{root}/step-0000000{s}" for s in (1, 2, 3)]
    assert manager.latest_name == "step-00000003" and manager.best_name == "step-00000001"
    folder, manifest, state, train_state = manager.load_newest_valid()
    assert folder == f"{root}/step-00000003" and manifest["step"] == 3 and train_state["loop"]["step"] == 3
    for name, tensor in models[3].state_dict().items():
        assert torch.equal(state[name], tensor), name
    _save(manager, 4, _model(4))
    assert [storage.name_of(f) for f in complete_checkpoints(root)] == [
        "step-00000001",
        "step-00000003",
        "step-00000004",
    ]
    # Any reader of checkpoints takes the s3:// root, by the local rule: `best` (step 1) for loading a
    # model, `latest` (step 4) for resuming.
    _, weights, _ = load_weights(root)
    assert torch.equal(weights["tok_embeddings.weight"], models[1].state_dict()["tok_embeddings.weight"])
    assert resolve_checkpoint(root, pointer="latest").name == "step-00000004"


def test_killed_upload_leaves_no_checkpoint(s3_bucket, cache, monkeypatch):
    root = f"{s3_bucket}/ckpt"
    manager = checkpoint_manager(root)
    _save(manager, 1, _model(1))
    real, uploaded = storage.upload, []

    def dies_after_one_file(local, remote):
        if uploaded:
            raise ConnectionError("upload killed")
        uploaded.append(remote)
        real(local, remote)

    monkeypatch.setattr(storage, "upload", dies_after_one_file)
    with pytest.raises(ConnectionError):
        _save(manager, 2, _model(2))
    monkeypatch.setattr(storage, "upload", real)
    # One file of step 2 reached the store, and still no reader takes step 2 for a checkpoint.
    assert uploaded and uploaded[0].startswith(f"{root}/step-00000002/")
    assert storage.exists(uploaded[0])
    assert complete_checkpoints(root) == [f"{root}/step-00000001"]
    assert manager.latest_name == "step-00000001"
    assert json.loads((resolve_checkpoint(root) / "manifest.json").read_text())["step"] == 1
    with pytest.raises(CheckpointError, match="missing"):
        manager.load(f"{root}/step-00000002")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        folder, manifest, *_ = manager.load_newest_valid()
    assert folder == f"{root}/step-00000001"
    # The next save of that step overwrites the leftovers and publishes normally.
    _save(manager, 2, _model(2))
    assert complete_checkpoints(root)[-1] == f"{root}/step-00000002"


def test_corrupted_remote_file_is_refused_and_skipped(s3_bucket, cache):
    root = f"{s3_bucket}/ckpt"
    manager = checkpoint_manager(root)
    _save(manager, 1, _model(1))
    _save(manager, 2, _model(2))
    storage.write_bytes(f"{root}/step-00000002/model.safetensors", b"not the weights")
    with pytest.warns(UserWarning, match="skipping checkpoint step-00000002"):
        folder, *_ = manager.load_newest_valid(quarantine=True)
    assert folder == f"{root}/step-00000001"
    assert complete_checkpoints(root) == [f"{root}/step-00000001"] and manager.latest_name == "step-00000001"
    assert storage.isfile(f"{root}/damaged/step-00000002/manifest.json")


def test_cached_copy_is_checked_again(s3_bucket, cache):
    root = f"{s3_bucket}/ckpt"
    _save(checkpoint_manager(root), 1, _model(1))
    local = resolve_checkpoint(root)
    (local / "model.safetensors").write_bytes(b"damaged in the cache")
    again = resolve_checkpoint(root)
    assert again == local
    _, weights, _ = load_weights(again)
    assert torch.equal(weights["tok_embeddings.weight"], _model(1).state_dict()["tok_embeddings.weight"])


@pytest.mark.slow  # three short training runs (~25 s on 2 shared cores)
def test_trainer_resumes_from_s3(s3_bucket, cache, tmp_path, tiny_pack_factory):
    pack = tiny_pack_factory(tmp_path / "pack")
    model_cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, max_seq_len=16)
    root = f"{s3_bucket}/run/checkpoints"

    def run(out, max_steps, resume="auto", **kw):
        cfg = tiny_train_config(max_steps=max_steps, ckpt_every=2, eval_every=2, eval_batches=1, **kw)
        trainer = Trainer(model_cfg, cfg, pack, out, device="cpu", resume=resume)
        trainer.fit()
        return trainer

    run(tmp_path / "a", 4, checkpoint_dir=root)
    assert complete_checkpoints(root) == [f"{root}/step-00000002", f"{root}/step-00000004"]
    # The upload of step 4 killed before its manifest: the run resumes from step 2 and must end
    # where an uninterrupted run ends.
    storage.remove(f"{root}/step-00000004/manifest.json")
    assert complete_checkpoints(root) == [f"{root}/step-00000002"]
    resumed = run(tmp_path / "a", 4, checkpoint_dir=root)
    assert resumed.step == 4 and complete_checkpoints(root)[-1] == f"{root}/step-00000004"
    run(tmp_path / "c", 4)
    _, s3_weights, _ = load_weights(root)
    _, local_weights, _ = load_weights(tmp_path / "c" / "checkpoints")
    for name, tensor in local_weights.items():
        assert torch.equal(s3_weights[name], tensor), name
    # Resuming from a named step of the same root moves the later steps aside (rewind), as on disk.
    with pytest.warns(UserWarning, match="newer than the resumed step 2"):
        run(tmp_path / "a", 4, checkpoint_dir=root, resume=f"{root}/step-00000002")
    assert storage.isfile(f"{root}/abandoned-step-00000004/manifest.json")
    _, again, _ = load_weights(root)
    assert all(torch.equal(again[name], tensor) for name, tensor in local_weights.items())
