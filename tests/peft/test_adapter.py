import pytest
import torch
import torch.nn.functional as F

from kiln.peft import (
    PeftConfig,
    adapter_modules,
    adapter_state_dict,
    apply_peft,
    load_trainable,
    merged_state_dict,
    parameter_counts,
    peft_disabled,
    save_peft_adapter,
    save_trainable,
    trainable_parameters,
)


def test_adapters_start_as_identity_and_only_they_train(tiny_model, tokens):
    model = tiny_model()
    with torch.no_grad():
        before = model(tokens)
    apply_peft(model, PeftConfig(method="adapter", adapter_hidden=8))
    assert sorted(adapter_modules(model)) == [f"layers.{i}.{s}.adapter" for i in range(2) for s in ("attn", "ffn")]
    dim = model.cfg.dim
    trainable, _ = parameter_counts(model)
    assert trainable == 4 * (dim * 8 + 8 + 8 * dim + dim)
    assert all(".adapter." in n for n, _ in trainable_parameters(model))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)


def test_adapter_sits_on_the_sublayer_output_before_the_residual(tiny_model, fill_peft):
    model = fill_peft(apply_peft(tiny_model(), PeftConfig(method="adapter", adapter_hidden=8)))
    block = model.layers[0]
    x = torch.randn(2, 10, model.cfg.dim)
    cos, sin = model.rope_cos[:10].unsqueeze(1), model.rope_sin[:10].unsqueeze(1)
    with torch.no_grad():
        with peft_disabled(model):
            attn = block.attn(block.attn_norm(x), cos, sin)
        a = block.attn.adapter
        adapted_attn = attn + F.linear(
            F.gelu(F.linear(attn, a.down.weight, a.down.bias), approximate="tanh"), a.up.weight, a.up.bias
        )
        h = x + adapted_attn
        with peft_disabled(model):
            ffn = block.ffn(block.ffn_norm(h))
        f = block.ffn.adapter
        expected = h + ffn + f.up(F.gelu(f.down(ffn), approximate="tanh"))
        torch.testing.assert_close(block(x, cos, sin), expected, rtol=1e-5, atol=1e-5)


def test_adapter_training_and_kiln_format_round_trip(tiny_model, tokens, tmp_path):
    model = tiny_model()
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = PeftConfig(method="adapter", adapter_hidden=16)
    apply_peft(model, cfg).train()
    opt = torch.optim.AdamW([p for _, p in trainable_parameters(model)], lr=1e-2)
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    model.eval()
    save_trainable(model, cfg, tmp_path)
    # Only the adapters are written (float32), not the frozen base.
    size = (tmp_path / "kiln_peft.safetensors").stat().st_size
    assert size < 4 * sum(t.numel() for t in adapter_state_dict(model).values()) + 4096
    fresh = tiny_model()
    fresh.load_state_dict(base_state)
    assert load_trainable(fresh, tmp_path) == cfg
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), model(tokens), rtol=0, atol=0)
    assert sorted(n for n, _ in trainable_parameters(fresh)) == sorted(n for n, _ in trainable_parameters(model))


def test_adapters_cannot_be_merged_or_written_as_peft(tiny_model, tmp_path):
    model = apply_peft(tiny_model(), PeftConfig(method="adapter", adapter_hidden=4))
    with pytest.raises(ValueError, match="cannot be merged"):
        merged_state_dict(model)
    with pytest.raises(ValueError, match="no LoRA layers"):
        save_peft_adapter(model, model.cfg, tmp_path)
