import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.peft import (
    LoRAConfig,
    LoRALinear,
    PeftConfig,
    apply_lora,
    apply_peft,
    load_lora_state_dict,
    lora_modules,
    lora_scaling,
    lora_state_dict,
    merge_lora,
    parameter_counts,
    peft_disabled,
    trainable_parameters,
    unmerge_lora,
)


def test_scaling_matches_the_peft_anchor():
    # anchors-post.md 2.9: r=8, alpha=16 -> 2.0; rsLoRA -> alpha / sqrt(r) = 5.6568542495.
    assert lora_scaling(8, 16) == 2.0
    assert lora_scaling(8, 16, rslora=True) == pytest.approx(5.6568542495, abs=1e-10)
    assert PeftConfig(method="lora", r=8, alpha=16, rslora=True).scaling == pytest.approx(16 / math.sqrt(8))


@pytest.mark.parametrize(
    "field,value",
    [
        ("method", "dora"),
        ("r", 0),
        ("r", 2.5),
        ("alpha", 0),
        ("dropout", 1.0),
        ("targets", []),
        ("targets", "wqkv"),
        ("lora_dtype", "fp8"),
        ("adapter_hidden", 0),
        ("nf4_block_size", 63),
    ],
)
def test_config_errors_name_the_key(field, value):
    with pytest.raises(ConfigError) as err:
        PeftConfig(**{"method": "lora", field: value}).validate()
    assert err.value.key == field


def test_apply_wraps_targets_freezes_base_and_starts_as_the_base(tiny_model, tokens):
    model = tiny_model()
    before = model(tokens)
    apply_peft(model, PeftConfig(method="lora", r=4, targets=["attn.wqkv", "ffn.w2", "output"]))
    assert sorted(lora_modules(model)) == [
        "layers.0.attn.wqkv",
        "layers.0.ffn.w2",
        "layers.1.attn.wqkv",
        "layers.1.ffn.w2",
        "output",
    ]
    names = [n for n, _ in trainable_parameters(model)]
    assert names and all(n.endswith(("lora_A", "lora_B")) for n in names)
    cfg = model.cfg
    qkv_out = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim
    per_layer = 4 * (cfg.dim + qkv_out) + 4 * (cfg.ffn_hidden_size + cfg.dim)
    trainable, total = parameter_counts(model)
    assert trainable == 2 * per_layer + 4 * (cfg.dim + cfg.vocab_size)
    assert total == trainable + sum(p.numel() for p in model.parameters() if not p.requires_grad)
    # B = 0 at init: exactly the base model's function.
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)


def test_targets_that_match_nothing_are_config_errors(tiny_model):
    with pytest.raises(ConfigError, match="matches no linear layer") as err:
        apply_lora(tiny_model(), LoRAConfig(targets=["attn.wq"]))
    assert err.value.key == "targets"
    with pytest.raises(ConfigError, match="tied embeddings"):
        apply_lora(tiny_model(tie_embeddings=True), LoRAConfig(targets=["output"]))


class _OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(24, 40, bias=True)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("rslora", [False, True])
def test_forward_and_gradients_match_peft_lora_layer(rslora):
    """Same weights in PEFT's own LoRA Linear and in Kiln's: same output and same gradients."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # peft imports torchao when installed
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    ours, theirs = _OneLinear(), _OneLinear()
    theirs.load_state_dict(ours.state_dict())
    apply_lora(ours, LoRAConfig(r=4, alpha=8, targets=["proj"], rslora=rslora))
    theirs = peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], use_rslora=rslora), theirs
    )
    layer = ours.proj
    with torch.no_grad():
        layer.lora_B.normal_()
        theirs.proj.lora_A["default"].weight.copy_(layer.lora_A)
        theirs.proj.lora_B["default"].weight.copy_(layer.lora_B)
    assert theirs.proj.scaling["default"] == layer.scaling
    x = torch.randn(3, 5, 24)
    out_ours, out_theirs = ours(x), theirs(x)
    torch.testing.assert_close(out_ours, out_theirs, rtol=1e-6, atol=1e-6)
    out_ours.square().sum().backward()
    out_theirs.square().sum().backward()
    torch.testing.assert_close(layer.lora_A.grad, theirs.proj.lora_A["default"].weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.lora_B.grad, theirs.proj.lora_B["default"].weight.grad, rtol=1e-5, atol=1e-5)
    # ...and both are the plain formula W x + b + s B A x.
    expected = F.linear(x, layer.base.weight, layer.base.bias) + layer.scaling * x @ layer.lora_A.T @ layer.lora_B.T
    torch.testing.assert_close(out_ours, expected, rtol=1e-5, atol=1e-5)


def test_merge_equals_unmerged_forward_and_unmerge_restores(tiny_model, tokens, fill_peft):
    model = tiny_model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        base_logits = model(tokens)
    apply_peft(
        model,
        PeftConfig(
            method="lora", r=4, rslora=True, targets=["attn.wqkv", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2", "output"]
        ),
    )
    fill_peft(model)
    with torch.no_grad():
        unmerged = model(tokens)
        assert (unmerged - base_logits).abs().max() > 0.1  # the LoRA update is not negligible
        merge_lora(model)
        assert all(m.merged for m in lora_modules(model).values())
        assert not torch.allclose(model.output.base.weight, original["output.weight"])
        torch.testing.assert_close(model(tokens), unmerged, rtol=1e-4, atol=1e-4)
        unmerge_lora(model)
        for name in ("output", "layers.1.attn.wqkv", "layers.0.ffn.w3"):
            torch.testing.assert_close(
                model.get_submodule(name).base.weight, original[f"{name}.weight"], rtol=0, atol=1e-6
            )
        torch.testing.assert_close(model(tokens), unmerged, rtol=1e-4, atol=1e-4)


def test_dropout_applies_to_the_lora_path_only_in_training(tiny_model, tokens, fill_peft):
    model = fill_peft(apply_lora(tiny_model(), LoRAConfig(r=4, dropout=0.5)))
    reference = apply_lora(tiny_model(), LoRAConfig(r=4))
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)  # eval: no dropout
        model.train()
        assert not torch.allclose(model(tokens), reference(tokens))
        with peft_disabled(model), peft_disabled(reference):  # the base path never drops anything
            torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)


def test_only_lora_weights_train(tiny_model, tokens):
    model = apply_peft(tiny_model(), PeftConfig(method="lora", r=4, alpha=8))
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    opt = torch.optim.AdamW([p for _, p in trainable_parameters(model)], lr=1e-2)
    model.train()
    losses = []
    for _ in range(15):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    for k, v in model.state_dict().items():
        if k in frozen:
            torch.testing.assert_close(v, frozen[k], rtol=0, atol=0)


def test_state_dict_holds_only_lora_and_round_trips(tiny_model, tokens, fill_peft):
    model = fill_peft(apply_lora(tiny_model(), LoRAConfig(r=2)))
    state = lora_state_dict(model)
    assert set(state) == {f"{n}.lora_{x}" for n in lora_modules(model) for x in "AB"}
    assert sum(t.numel() for t in state.values()) < 0.1 * sum(p.numel() for p in model.parameters())
    fresh = apply_lora(tiny_model(), LoRAConfig(r=2))
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if "lora" not in k}, strict=False)
    load_lora_state_dict(fresh, state)
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), model(tokens), rtol=0, atol=0)
    with pytest.raises(ValueError, match="missing"):
        load_lora_state_dict(fresh, {k: v for k, v in state.items() if "layers.0" not in k})
    with pytest.raises(ValueError, match="shape"):
        load_lora_state_dict(apply_lora(tiny_model(), LoRAConfig(r=3)), state)


def test_peft_disabled_gives_the_base_and_refuses_merged(tiny_model, tokens, fill_peft):
    model = tiny_model()
    with torch.no_grad():
        base = model(tokens)
        fill_peft(apply_peft(model, PeftConfig(method="lora", r=4)))
        adapted = model(tokens)
        with peft_disabled(model):
            torch.testing.assert_close(model(tokens), base, rtol=0, atol=0)
        torch.testing.assert_close(model(tokens), adapted, rtol=0, atol=0)
        merge_lora(model)
        with pytest.raises(ValueError, match="unmerge"):
            with peft_disabled(model):
                pass


def test_moe_model_takes_lora_on_attention(tiny_model, tokens, fill_peft):
    model = tiny_model(moe_every=1, n_experts=4, moe_top_k=2)
    fill_peft(apply_peft(model, PeftConfig(method="lora", r=2, targets=["attn.wqkv", "attn.wo"])))
    assert len(lora_modules(model)) == 4
    with torch.no_grad():
        unmerged = model(tokens)
        merge_lora(model)
        torch.testing.assert_close(model(tokens), unmerged, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="ffn.w1"):
        apply_peft(tiny_model(moe_every=1, n_experts=4, moe_top_k=2), PeftConfig(method="lora", targets=["ffn.w1"]))


@pytest.mark.parametrize("target", ["ffn.w13", "w13", "shared_expert.w13"])
def test_the_fused_gate_up_target_of_weights_layout_2_is_refused_by_name(target):
    with pytest.raises(ConfigError, match=r"^targets: .*no longer exists.*ffn\.w1 and ffn\.w3"):
        PeftConfig(method="lora", targets=["attn.wqkv", target]).validate()


def test_none_method_leaves_the_model_alone(tiny_model):
    model = tiny_model()
    assert apply_peft(model, PeftConfig()) is model
    assert all(p.requires_grad for p in model.parameters())
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
