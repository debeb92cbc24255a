"""parallel.async_checkpoint without sharded checkpoints (one process, DDP): the state is copied
when the save is called and written, checksummed and published by a background thread."""

import threading

import pytest
import torch
from kiln_testing.train import tiny_train_config

import kiln.checkpoint.manager as manager_module
from kiln.checkpoint import CheckpointManager
from kiln.model import ModelConfig, build_model
from kiln.model.weights import load_weights
from kiln.parallel.config import ParallelConfig
from kiln.train.trainer import Trainer

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def _held_writer(monkeypatch):
    """write_files that waits for `release` and records the thread it ran in."""
    release, threads = threading.Event(), []
    write = manager_module.write_files

    def held(*args, **kwargs):
        threads.append(threading.current_thread())
        release.wait(timeout=60)  # a guard against hanging if the save were synchronous
        return write(*args, **kwargs)

    monkeypatch.setattr(manager_module, "write_files", held)
    return release, threads


def test_save_returns_before_the_write_and_publishes_the_state_of_the_call(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = build_model(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 64, (2, 8))).float().mean().backward()
    opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moment = opt.state[model.tok_embeddings.weight]["exp_avg"].clone()
    release, threads = _held_writer(monkeypatch)
    manager = CheckpointManager(tmp_path / "ckpt", background=True)

    folder = manager.save(3, CFG, model.state_dict(), {"optimizer": opt.state_dict()}, {"tokens_seen": 30})
    assert not folder.exists() and manager.latest_name is None  # still being written
    with torch.no_grad():  # training goes on while the thread writes
        for p in model.parameters():
            p.add_(1.0)
    opt.state[model.tok_embeddings.weight]["exp_avg"].add_(1.0)
    release.set()
    manager.finish()

    assert threads and threads[0] is not threading.main_thread()
    assert manager.latest_name == folder.name
    manifest, state, train_state = manager.load(folder)
    assert manifest["step"] == 3 and manifest["tokens_seen"] == 30
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    moments = [s["exp_avg"] for s in train_state["optimizer"]["state"].values()]
    assert any(torch.equal(m, expected_moment) for m in moments)


def test_tensors_sharing_memory_share_their_copy_and_are_stored_once(tmp_path):
    weight = torch.randn(4, 4)
    state = {"embed.weight": weight, "head.weight": weight.detach()}  # one storage under two names
    manager = CheckpointManager(tmp_path / "ckpt", background=True)
    folder = manager.save(1, CFG, state, {}, {})
    manager.finish()
    manifest, loaded, _ = manager.load(folder)
    assert manifest["tied"] == {"head.weight": "embed.weight"}
    assert torch.equal(loaded["head.weight"], weight)


def test_an_error_in_the_writer_is_raised_by_the_next_save(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(manager_module, "write_files", broken)
    manager = CheckpointManager(tmp_path / "ckpt", background=True)
    model = build_model(CFG)
    manager.save(1, CFG, model.state_dict(), {}, {})
    with pytest.raises(OSError, match="disk full"):
        manager.save(2, CFG, model.state_dict(), {}, {})


def test_trainer_with_async_checkpoint_writes_in_the_background_the_same_checkpoints(
    tiny_pack_factory, tmp_path, monkeypatch
):
    pack = tiny_pack_factory(tmp_path / "pack")
    train = tiny_train_config(max_steps=4, ckpt_every=2, eval_every=2, keep_last=3)
    Trainer(MODEL, train, pack, tmp_path / "sync", resume="none").fit()
    release, threads = _held_writer(monkeypatch)
    release.set()
    parallel = ParallelConfig(async_checkpoint=True)
    Trainer(MODEL, train, pack, tmp_path / "async", resume="none", parallel=parallel).fit()
    assert len(threads) == 2 and all(t is not threading.main_thread() for t in threads)
    for step in ("step-00000002", "step-00000004"):
        expected = load_weights(tmp_path / "sync" / "checkpoints" / step)[1]
        weights = load_weights(tmp_path / "async" / "checkpoints" / step)[1]
        for name, tensor in expected.items():
            assert torch.equal(weights[name], tensor), f"{step} {name}"
