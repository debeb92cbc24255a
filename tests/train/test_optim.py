import copy

import pytest
import torch
from kiln_testing.optim import Small
from torch import nn

from kiln.errors import ConfigError
from kiln.model import ModelConfig, build_model
from kiln.train.config import TrainConfig
from kiln.train.optim import Lion, build_optimizer, param_groups


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 11, (4, 3), generator=g)
    return model(x).square().mean()


def _run(model, opt, steps=5, lrs=(1e-2, 5e-3, 2e-3, 1e-3, 1e-4)):
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def test_decay_groups_small_model():
    model = Small()
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model.proj.weight), id(model.head.weight)}
    assert {id(p) for p in no_decay["params"]} == {
        id(model.emb.weight),
        id(model.norm.weight),
        id(model.norm.bias),
        id(model.proj.bias),
    }


@pytest.mark.parametrize("tied", [False, True])
def test_decay_groups_transformer(tied):
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=tied, qkv_bias=True)
    )
    groups = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in groups[0]["params"]}
    not_decayed = {names[id(p)] for p in groups[1]["params"]}
    assert all(n.endswith("weight") and "norm" not in n and "embeddings" not in n for n in decayed)
    assert "tok_embeddings.weight" in not_decayed
    assert ("output.weight" in decayed) == (not tied)
    assert any(n.endswith("bias") for n in not_decayed) and any("norm" in n for n in not_decayed)
    assert len(decayed) + len(not_decayed) == len(list(model.parameters()))


def test_adamw_matches_torch_reference_bit_for_bit():
    torch.manual_seed(0)
    model = Small()
    reference = copy.deepcopy(model)
    cfg = TrainConfig(optimizer="adamw", lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.3)
    opt = build_optimizer(model, cfg)
    ref_groups = [
        {"params": [reference.proj.weight, reference.head.weight], "weight_decay": 0.3},
        {
            "params": [reference.emb.weight, reference.norm.weight, reference.norm.bias, reference.proj.bias],
            "weight_decay": 0.0,
        },
    ]
    # The plain (single-tensor, for-loop) implementation, not the fused kernel build_optimizer picks.
    ref_opt = torch.optim.AdamW(ref_groups, lr=1e-2, betas=(0.8, 0.9), eps=1e-6, foreach=False)
    _run(model, opt)
    _run(reference, ref_opt)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(model.proj.weight, Small().proj.weight)


def _lion_reference(params, grads_per_step, lrs, beta1, beta2, wd_of):
    """Chen et al. 2023, Algorithm 2, written out directly."""
    params = [p.detach().clone() for p in params]
    moms = [torch.zeros_like(p) for p in params]
    for grads, lr in zip(grads_per_step, lrs):
        for i, (p, g) in enumerate(zip(params, grads)):
            c = beta1 * moms[i] + (1 - beta1) * g
            params[i] = p - lr * (torch.sign(c) + wd_of(i) * p)
            moms[i] = beta2 * moms[i] + (1 - beta2) * g
    return params


def test_lion_matches_formula():
    torch.manual_seed(0)
    model = Small()
    start = [p.detach().clone() for p in model.parameters()]
    cfg = TrainConfig(optimizer="lion", lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.5)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, Lion)
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    lrs = (1e-2, 5e-3, 2e-3)
    grads_per_step = []
    for step, lr in enumerate(lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        _loss(model, step).backward()
        grads_per_step.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    ids = [id(p) for p in model.parameters()]
    expected = [s.clone() for s in start]
    expected = _lion_reference(expected, grads_per_step, lrs, 0.9, 0.99, lambda i: 0.5 if ids[i] in decayed else 0.0)
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=0, atol=1e-7)


def test_lion_hand_computed_scalar():
    p = nn.Parameter(torch.tensor([1.0]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    p.grad = torch.tensor([0.5])
    opt.step()
    # update = sign(0.9*0 + 0.1*0.5) = 1; p = 1 - 0.1*(1 + 0.1*1) = 0.89; m = 0.01*0.5 = 0.005
    assert p.item() == pytest.approx(0.89, abs=1e-7)
    assert opt.state[p]["exp_avg"].item() == pytest.approx(0.005, abs=1e-9)
    p.grad = torch.tensor([-1.0])
    opt.step()
    # c = 0.9*0.005 - 0.1 < 0 -> update -1; p = 0.89 - 0.1*(-1 + 0.1*0.89) = 0.9811
    assert p.item() == pytest.approx(0.9811, abs=1e-6)
    assert opt.state[p]["exp_avg"].item() == pytest.approx(-0.00505, abs=1e-9)


def test_adafactor_matches_torch():
    torch.manual_seed(0)
    model = Small()
    reference = copy.deepcopy(model)
    cfg = TrainConfig(optimizer="adafactor", lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, cfg)
    assert isinstance(opt, torch.optim.Adafactor)
    ref_opt = torch.optim.Adafactor(param_groups(reference, 0.1), lr=1e-2)
    _run(model, opt)
    _run(reference, ref_opt)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_optimizer_state_roundtrips_weights_only(tmp_path):
    model = Small()
    opt = build_optimizer(model, TrainConfig(optimizer="lion"))
    _run(model, opt, steps=1)
    torch.save(opt.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    fresh = build_optimizer(Small(), TrainConfig(optimizer="lion"))
    fresh.load_state_dict(state)
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def _fused_cfg(impl: str) -> TrainConfig:
    return TrainConfig(
        optimizer="adamw", optimizer_impl=impl, lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.3
    )


def _run_steps(model, opt, steps: range, lrs=(1e-2, 5e-3, 2e-3, 1e-3, 1e-4, 3e-3)):
    for step in steps:
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def test_fused_adamw_resumed_through_a_saved_state_equals_uninterrupted(tmp_path):
    torch.manual_seed(0)
    model = Small(unused=True)
    resumed_model = copy.deepcopy(model)
    opt = build_optimizer(model, _fused_cfg("fused"))
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    _run_steps(model, opt, range(6))

    first = build_optimizer(resumed_model, _fused_cfg("fused"))
    _run_steps(resumed_model, first, range(3))
    torch.save({"model": resumed_model.state_dict(), "optimizer": first.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = Small(unused=True)
    fresh.load_state_dict(saved["model"])
    second = build_optimizer(fresh, _fused_cfg("fused"))
    second.load_state_dict(saved["optimizer"])
    _run_steps(fresh, second, range(3, 6))
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    assert not fresh.unused.grad and not second.state.get(fresh.unused)


def test_fused_adamw_agrees_with_foreach_to_rounding():
    """Same formula, different order of float32 operations (the fused kernel folds the bias
    corrections and the decoupled decay into one pass), so equal to within a few ulps per step,
    not bit for bit."""
    torch.manual_seed(0)
    model = Small()
    other = copy.deepcopy(model)
    start = copy.deepcopy(model)
    _run_steps(model, build_optimizer(model, _fused_cfg("fused")), range(6))
    _run_steps(other, build_optimizer(other, _fused_cfg("foreach")), range(6))
    for (name, p), q, p0 in zip(model.named_parameters(), other.parameters(), start.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(p, p0), name  # the steps moved it, so the agreement is not vacuous


def test_fused_adamw_is_refused_where_it_would_not_apply():
    with pytest.raises(
        ConfigError,
        match=r"^optimizer_impl: fused applies to adamw \(and muon's AdamW part\) only; optimizer is 'lion'",
    ):
        TrainConfig(optimizer="lion", optimizer_impl="fused").validate()
    with pytest.raises(ConfigError, match=r"^optimizer_impl: fused keeps AdamW's moments in memory"):
        TrainConfig(optimizer_impl="fused", optimizer_offload="nvme").validate()
    with pytest.raises(ConfigError, match=r"^optimizer_impl: must be one of foreach, fused, got 'apex'"):
        TrainConfig(optimizer_impl="apex").validate()
    meta = nn.Linear(3, 3, device="meta")
    with pytest.raises(ConfigError, match=r"^optimizer_impl: fused AdamW runs on cpu, cuda, not \['meta'\]"):
        build_optimizer(meta, _fused_cfg("fused"))
