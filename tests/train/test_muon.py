"""train.optimizer = "muon": torch.optim.Muon on the block matrices, torch.optim.AdamW on the rest."""

import copy
import json
import shutil

import pytest
import torch
from kiln_testing.train import tiny_train_config

from kiln.errors import ConfigError
from kiln.model import ModelConfig, build_model
from kiln.model.weights import load_weights
from kiln.peft.lora import LoRAConfig, apply_lora
from kiln.train import muon as muon_module
from kiln.train.config import TrainConfig
from kiln.train.muon import Muon, newton_schulz
from kiln.train.optim import build_optimizer, param_groups
from kiln.train.schedule import lr_at
from kiln.train.trainer import Trainer

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, qkv_bias=True)
TRAIN_MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


def _step(model, opt, step, lr):
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)
    opt.zero_grad(set_to_none=True)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
    model(x).logsumexp(-1).mean().backward()
    opt.step()


def _muon_names(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p in opt.muon.param_groups[0]["params"]}


def test_adjust_lr_and_default_lr_reach_torch_muon():
    model = build_model(MODEL)
    opt = build_optimizer(model, TrainConfig(optimizer="muon", lr=3e-3, muon_adjust_lr="match_rms_adamw"))
    group = opt.muon.param_groups[0]
    assert group["adjust_lr_fn"] == "match_rms_adamw" and group["lr"] == 3e-3 and group["lr_ratio"] == 1.0
    group = build_optimizer(model, TrainConfig(optimizer="muon", lr=3e-3)).muon.param_groups[0]
    assert group["lr"] == 0.02 and group["lr_ratio"] == pytest.approx(0.02 / 3e-3)


def test_optimizer_impl_fused_reaches_muons_adamw_part():
    model = build_model(MODEL)
    fused = build_optimizer(model, TrainConfig(optimizer="muon", optimizer_impl="fused")).adamw
    plain = build_optimizer(model, TrainConfig(optimizer="muon")).adamw
    assert fused.defaults["fused"] is True and not fused.defaults["foreach"]
    assert not plain.defaults["fused"] and plain.defaults["foreach"] is True


def test_muon_and_adamw_halves_equal_torch_alone():
    adjust = "original"
    torch.manual_seed(0)
    model = build_model(MODEL)
    start = copy.deepcopy(model.state_dict())
    cfg = TrainConfig(
        optimizer="muon",
        lr=3e-3,
        muon_lr=0.05,
        muon_momentum=0.9,
        muon_ns_steps=4,
        muon_adjust_lr=adjust,
        muon_ns_dtype="bfloat16",  # torch.optim.Muon's own step
    )
    opt = build_optimizer(model, cfg)
    muon_names = _muon_names(model, opt)
    # Every block matrix and nothing else: embeddings, the head, norms and biases stay with AdamW.
    expected = {n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")}
    assert muon_names == expected and "output.weight" not in muon_names

    reference = copy.deepcopy(model)
    params = dict(reference.named_parameters())
    ref_muon = torch.optim.Muon(
        [params[n] for n in sorted(muon_names, key=list(params).index)],
        lr=0.05,
        weight_decay=0.1,
        momentum=0.9,
        ns_steps=4,
        adjust_lr_fn=adjust,
    )
    ref_groups = [
        {**g, "params": [p for p, n in zip(g["params"], _names_of(reference, g)) if n not in muon_names]}
        for g in param_groups(reference, 0.1)
    ]
    ref_adamw = torch.optim.AdamW(ref_groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    for step, lr in enumerate([3e-3, 2e-3, 1e-3]):
        _step(model, opt, step, lr)
        for group in ref_adamw.param_groups:
            group["lr"] = lr
        for group in ref_muon.param_groups:
            group["lr"] = 0.05 * lr / 3e-3
        ref_adamw.zero_grad(set_to_none=True)
        ref_muon.zero_grad(set_to_none=True)
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        reference(x).logsumexp(-1).mean().backward()
        ref_muon.step()
        ref_adamw.step()
    moved = 0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
        moved += not torch.equal(p, start[name])
    assert moved == len(list(model.parameters()))


def _names_of(model, group):
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in group["params"]]


def test_state_dict_resumes_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = build_model(MODEL)
    cfg = TrainConfig(optimizer="muon", lr=3e-3)
    opt = build_optimizer(model, cfg)
    _step(model, opt, 0, 3e-3)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "s.pt")
    _step(model, opt, 1, 2e-3)
    saved = torch.load(tmp_path / "s.pt", weights_only=True)
    resumed = build_model(MODEL)
    resumed.load_state_dict(saved["model"])
    fresh = build_optimizer(resumed, cfg)
    fresh.load_state_dict(saved["optimizer"])
    _step(resumed, fresh, 1, 2e-3)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ConfigError, match="optimizer"):
        fresh.load_state_dict(torch.optim.AdamW(resumed.parameters()).state_dict())


def test_muon_keys_refused_without_muon_and_bad_values():
    for key, value in [
        ("muon_lr", 0.02),
        ("muon_momentum", 0.9),
        ("muon_ns_steps", 3),
        ("muon_adjust_lr", "match_rms_adamw"),
        ("muon_ns_dtype", "float32"),
    ]:
        with pytest.raises(ConfigError, match=key):
            TrainConfig(**{key: value}).validate()
    for key, value in [
        ("muon_lr", -1.0),
        ("muon_momentum", 1.0),
        ("muon_ns_steps", 100),
        ("muon_adjust_lr", "x"),
        ("muon_ns_dtype", "float16"),
    ]:
        with pytest.raises(ConfigError, match=key):
            TrainConfig(optimizer="muon", **{key: value}).validate()
    with pytest.raises(ConfigError, match="optimizer_offload"):
        TrainConfig(optimizer="muon", optimizer_offload="nvme").validate()


def _matrices(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(rows, cols, generator=gen)) for rows, cols in [(48, 16), (16, 40), (24, 24)]]


def _run(opt, params, step_fn, steps=3):
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        step_fn()
        for group in opt.param_groups:
            group["lr"] *= 0.5


@pytest.mark.parametrize("adjust, nesterov", [("original", True), ("match_rms_adamw", True), ("original", False)])
def test_written_out_step_is_torchs_muon_bit_for_bit_in_bf16(adjust, nesterov):
    """Muon.step_in_dtype, the step that runs when the Newton-Schulz dtype is not bf16, is checked
    against torch.optim.Muon by running it in torch's bf16: every parameter and buffer bit-equal."""
    kwargs = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_steps=4, adjust_lr_fn=adjust)
    ours, theirs = _matrices(0), _matrices(0)
    kiln_muon = Muon(ours, ns_dtype=torch.bfloat16, **kwargs)
    torch_muon = torch.optim.Muon(theirs, **kwargs)
    _run(kiln_muon, ours, kiln_muon.step_in_dtype)
    _run(torch_muon, theirs, torch_muon.step)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(kiln_muon.state[p]["momentum_buffer"], torch_muon.state[q]["momentum_buffer"])


def test_float32_newton_schulz_is_the_bf16_update_without_its_rounding():
    """The fp32 iteration gives torch's bf16 update within bf16's rounding, the fp32 step moves the
    weights differently from the bf16 one (the dtype takes effect), and the state round-trips."""
    update = torch.randn(64, 24, generator=torch.Generator().manual_seed(3))
    coefficients = torch.optim.Muon([torch.nn.Parameter(update)]).defaults["ns_coefficients"]
    fp32 = newton_schulz(update, coefficients, 5, 1e-7, torch.float32)
    bf16 = newton_schulz(update, coefficients, 5, 1e-7, torch.bfloat16)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    torch.testing.assert_close(fp32, bf16.float(), atol=0.03, rtol=0.03)
    singular = torch.linalg.svdvals(fp32)
    assert singular.min() > 0.5 and singular.max() < 1.5  # orthogonalised: the quintic's band around 1
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = _matrices(1)
        opt = Muon(params, ns_dtype=dtype, lr=0.05)
        _run(opt, params, opt.step)
        runs[dtype] = params
    assert all(not torch.equal(p, q) for p, q in zip(runs[torch.float32], runs[torch.bfloat16]))
    for p, q in zip(runs[torch.float32], runs[torch.bfloat16]):
        torch.testing.assert_close(p, q, atol=0.01, rtol=0.01)


def test_ns_dtype_auto_is_float32_only_on_a_cpu_without_fast_bf16(monkeypatch):
    auto, model = TrainConfig(optimizer="muon"), build_model(MODEL)
    for fast, expected in [(False, torch.float32), (True, torch.bfloat16)]:
        monkeypatch.setattr(muon_module, "cpu_bf16_is_fast", lambda fast=fast: fast)
        assert muon_module.ns_dtype(auto, "cpu") == expected
        assert build_optimizer(model, auto).muon.ns_dtype == expected
        assert muon_module.ns_dtype(auto, "cuda") == torch.bfloat16
        for name in ("float32", "bfloat16"):
            assert muon_module.ns_dtype(TrainConfig(optimizer="muon", muon_ns_dtype=name), "cpu") == getattr(
                torch, name
            )


def test_muon_refuses_lora():
    model = apply_lora(build_model(MODEL), LoRAConfig())
    with pytest.raises(ConfigError, match="LoRA"):
        build_optimizer(model, TrainConfig(optimizer="muon"))


def test_trainer_muon_loss_falls_and_resumes_bit_exact(tiny_pack_factory, tmp_path):
    pack = tiny_pack_factory(tmp_path / "pack")
    cfg = tiny_train_config(optimizer="muon", lr=1e-2, muon_lr=0.02, max_steps=8, eval_every=4, ckpt_every=4)
    whole = tmp_path / "whole"
    first = Trainer(TRAIN_MODEL, cfg, pack, whole)
    first.fit()
    # Muon's lr follows the schedule from its own peak: the last step's lr times muon_lr / lr.
    last = lr_at(cfg.max_steps - 1, cfg)
    assert first.optimizer.muon.param_groups[0]["lr"] == pytest.approx(last * 0.02 / 1e-2)
    assert first.optimizer.adamw.param_groups[0]["lr"] == pytest.approx(last)
    losses = [
        r["loss"] for r in map(json.loads, (whole / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"
    ]
    assert losses[-1] < losses[0] - 0.5
    # Resume from the step-4 checkpoint of a copy and finish: the same weights as the whole run.
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000008")
    trainer = Trainer(TRAIN_MODEL, cfg, pack, cut)
    assert trainer.step == 4
    trainer.fit()
    _, a, _ = load_weights(whole)
    _, b, _ = load_weights(cut)
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name
