"""NVMe offload of AdamW's moments (kiln.train.offload) against torch.optim.AdamW in memory."""

import copy

import pytest
import torch
from kiln_testing.optim import Small
from kiln_testing.train import tiny_train_config

from kiln.errors import ConfigError
from kiln.model import ModelConfig
from kiln.model.weights import load_weights
from kiln.recipe import recipe_from_dict
from kiln.train.config import TrainConfig
from kiln.train.offload import NVMeAdamW
from kiln.train.optim import build_optimizer, param_groups
from kiln.train.trainer import Trainer

LRS = (1e-2, 5e-3, 2e-3, 1e-3, 1e-4, 3e-3, 7e-4)
HYPER = dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-6)


def _steps(model, opt, steps: range):
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = LRS[step]
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        model(torch.randint(0, 11, (4, 3), generator=g)).square().mean().backward()
        opt.step()


def _nvme(model, folder, chunk_bytes):
    return NVMeAdamW(param_groups(model, 0.3), folder, **HYPER, chunk_bytes=chunk_bytes, foreach=True)


def _assert_same(model, reference, opt, ref_opt):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    got, want = opt.state_dict(), ref_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["state"][i][key], value), (i, key)


# 200 bytes of state per chunk cuts the 11x6 embedding and the 11x5 head into several slices and
# puts several small parameters in one chunk; 1 MiB keeps each parameter group in one chunk.
@pytest.mark.parametrize("chunk_bytes", [200, 1 << 20])
def test_matches_torch_adamw_bit_for_bit(tmp_path, chunk_bytes):
    model = Small(unused=True)
    reference = copy.deepcopy(model)
    opt = _nvme(model, tmp_path, chunk_bytes)
    # torch's single-tensor reference loop, not the foreach path the offloaded update takes.
    ref_opt = torch.optim.AdamW(param_groups(reference, 0.3), **HYPER, foreach=False)
    _steps(model, opt, range(5))
    _steps(reference, ref_opt, range(5))
    assert not torch.equal(model.proj.weight, Small(unused=True).proj.weight)
    ref_opt.param_groups[0]["foreach"] = ref_opt.param_groups[1]["foreach"] = True  # only the path differs
    _assert_same(model, reference, opt, ref_opt)
    assert (len(opt.chunks) > 2) == (chunk_bytes == 200)
    # The step counts are the only state held in memory; the moments are in the files.
    assert not opt.state
    on_disk = sum(c.path.stat().st_size for c in opt.chunks)
    assert on_disk == 2 * 4 * sum(p.numel() for p in model.parameters())
    assert opt.resident_state_bytes() == 2 * max(c.nbytes for c in opt.chunks)


def test_resume_through_a_checkpoint_equals_uninterrupted(tmp_path):
    model = Small(unused=True)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(param_groups(reference, 0.3), **HYPER, foreach=True)
    _steps(reference, ref_opt, range(7))

    opt = _nvme(model, tmp_path / "a", 200)
    _steps(model, opt, range(4))
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    saved = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    # The offloaded state loads into torch's in-memory AdamW and back into an offloaded one.
    in_memory_model = copy.deepcopy(model)
    in_memory = torch.optim.AdamW(param_groups(in_memory_model, 0.3), **HYPER, foreach=True)
    in_memory.load_state_dict(saved)
    resumed = _nvme(model, tmp_path / "b", 120)
    resumed.load_state_dict(saved)
    _steps(model, resumed, range(4, 7))
    _steps(in_memory_model, in_memory, range(4, 7))
    _assert_same(model, reference, resumed, ref_opt)
    _assert_same(in_memory_model, reference, in_memory, ref_opt)


def test_close_removes_only_its_own_files(tmp_path):
    (tmp_path / "earlier.bin").write_bytes(b"kept")
    model = Small(unused=True)
    opt = _nvme(model, tmp_path, 200)
    _steps(model, opt, range(1))
    assert opt.folder.parent == tmp_path and any(opt.folder.iterdir())
    opt.close()
    assert [p.name for p in tmp_path.iterdir()] == ["earlier.bin"]


MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def test_trainer_nvme_equals_in_memory(tmp_path, tiny_pack_factory):
    """Resuming a Trainer run from an offloaded checkpoint is tests/train/test_resume.py's (slow) nvme case."""
    pack = tiny_pack_factory(tmp_path / "pack")
    cfg = dict(max_steps=6, ckpt_every=3, eval_every=3, weight_decay=0.1)
    Trainer(MODEL, tiny_train_config(**cfg), pack, tmp_path / "mem").fit()
    # Held, so that fit() and not the optimizer's garbage collection must remove the swap folder.
    offloaded = Trainer(
        MODEL, tiny_train_config(**cfg, optimizer_offload="nvme", optimizer_offload_chunk_mb=1), pack, tmp_path / "nvme"
    )
    offloaded.fit()
    assert isinstance(offloaded.optimizer, NVMeAdamW)
    _, want, _ = load_weights(tmp_path / "mem")
    _, got, manifest = load_weights(tmp_path / "nvme")
    assert manifest["step"] == 6
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    # The swap folder is gone once fit() returns; the offload folder itself stays.
    assert list((tmp_path / "nvme" / "optimizer_offload").iterdir()) == []


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match=r"^train\.optimizer_offload: nvme offloads AdamW's state only"):
        recipe_from_dict({"train": {"optimizer": "lion", "optimizer_offload": "nvme"}}).validate()
    with pytest.raises(ConfigError, match=r"^optimizer_offload: must be one of none, nvme"):
        TrainConfig(optimizer_offload="disk").validate()
    for key, value in (("optimizer_offload_dir", "/tmp/x"), ("optimizer_offload_chunk_mb", 8)):
        with pytest.raises(ConfigError, match=rf"^{key}: is set but optimizer_offload is 'none'"):
            TrainConfig(**{key: value}).validate()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = TrainConfig(optimizer_offload="nvme", optimizer_offload_dir=str(blocker / "swap"))
    with pytest.raises(ConfigError, match=rf"^optimizer_offload_dir: {blocker / 'swap'}: cannot write swap files"):
        build_optimizer(Small(unused=True), cfg)
