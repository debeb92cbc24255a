import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.model import build_model, preset
from kiln.peft import (
    NF4_LEVELS,
    NF4Linear,
    PeftConfig,
    apply_peft,
    base_state_dict,
    dequantize_nf4,
    load_trainable,
    lora_modules,
    merge_lora,
    merged_state_dict,
    nf4_bits_per_param,
    quantize_base,
    quantize_nf4,
    save_trainable,
    trainable_parameters,
)
from kiln.peft.nf4 import error_bound, storage_bits

# bitsandbytes' NF4 table (functional.py), as listed in anchors-post.md 2.10.
BNB_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]


def _torchao():
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # CPU-only: skip the CUDA kernels
    return pytest.importorskip("torchao.quantization")


def test_levels_are_bitsandbytes_nf4():
    assert list(NF4_LEVELS) == BNB_NF4


def test_codes_and_scalers_match_torchao_bit_for_bit():
    """torchao's to_nf4 (what torchtune's QLoRA uses) on the same weight: identical packed codes, int8
    scalers, per-group factors, mean and dequantised values. torchao stores the levels rounded to 4
    decimals; with its table passed in, the assignment to levels must agree everywhere."""
    torchao = _torchao()
    w = torch.randn(256, 128) * 0.02  # 32768 values: torchao needs a multiple of 64 * 256
    theirs = torchao.to_nf4(w, block_size=64, scaler_block_size=256)
    levels = tuple(theirs.nf4.tolist())
    assert max(abs(a - b) for a, b in zip(levels, NF4_LEVELS)) < 5e-5
    ours = quantize_nf4(w, 64, double_quant=True, levels=levels)
    assert torch.equal(ours["codes"], theirs.quantized_data)
    assert torch.equal(ours["scalers_q"], theirs.quantized_scalers)
    assert torch.equal(ours["scaler_factor"], theirs.quantization_factor)
    assert torch.equal(ours["scaler_mean"], theirs.scaler_mean)
    torch.testing.assert_close(
        dequantize_nf4(ours, w.shape, levels=levels), theirs.get_original_weight(), rtol=0, atol=0
    )


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("kind", ["normal", "heavy_tailed", "ragged", "with_zero_block"])
def test_round_trip_error_within_the_bound(kind, double_quant):
    gen = torch.Generator().manual_seed(0)
    shape = (100, 70) if kind == "ragged" else (192, 128)  # 7000 values: neither blocks nor groups fill up
    w = torch.randn(shape, generator=gen) * 0.02
    if kind == "heavy_tailed":  # outliers, as in real LLM weights: Student-t with 3 degrees of freedom
        w = torch.distributions.StudentT(3.0).sample(shape) * 0.02
    if kind == "with_zero_block":
        w.view(-1)[:128] = 0
    parts = quantize_nf4(w, 64, double_quant)
    deq = dequantize_nf4(parts, w.shape)
    err, bound = (deq - w).abs(), error_bound(w, parts, 64)
    assert (err <= bound).all(), f"worst error/bound {(err / bound).max():.4f}"
    # The bound is tight: half the widest level gap (-1 to -0.696) of a block absmax is nearly reached.
    assert (err / bound).max() > 0.8
    if kind == "with_zero_block":
        assert (deq.view(-1)[:128] == 0).all()


def test_nf4_beats_uniform_int4_on_normal_weights():
    """The point of NF4 (QLoRA sec. 3): levels at normal quantiles waste fewer codes than 16 evenly
    spaced ones for normally distributed weights, at the same block size."""
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    nf4 = dequantize_nf4(quantize_nf4(w, 64, double_quant=False), w.shape)
    blocks = w.view(-1, 64)
    scale = blocks.abs().amax(1, keepdim=True) / 7
    int4 = ((blocks / scale).round().clamp(-8, 7) * scale).view_as(w)
    nf4_rmse, int4_rmse = (nf4 - w).pow(2).mean().sqrt(), (int4 - w).pow(2).mean().sqrt()
    assert nf4_rmse < 0.9 * int4_rmse


def test_storage_is_4_127_bits_per_parameter_with_double_quantisation():
    w = torch.randn(512, 256)  # 131072 values: whole blocks and whole scaler groups
    # codes, int8 scalers, a float32 factor per 256 scalers, and one float32 mean for the tensor
    expected = 4 + 8 / 64 + 32 / (64 * 256) + 32 / w.numel()
    assert storage_bits(quantize_nf4(w, 64, True)) / w.numel() == pytest.approx(expected)
    assert storage_bits(quantize_nf4(w, 64, False)) / w.numel() == 4.5
    # The whole frozen base of the tiny preset: every block linear in NF4.
    model = quantize_base(build_model(preset("tiny", vocab_size=512)))
    bits = nf4_bits_per_param(model)
    assert 4.1 <= bits <= 4.5
    assert bits == pytest.approx(4.127, abs=1e-3)
    assert nf4_bits_per_param(quantize_base(build_model(preset("tiny", vocab_size=512)), double_quant=False)) == 4.5


def test_nf4_linear_forward_and_backward_use_the_dequantised_weight():
    linear = nn.Linear(64, 96, bias=True)
    q = NF4Linear.from_linear(linear)
    w = q.dequantize()
    assert (w - linear.weight).abs().max() < 0.2 * linear.weight.abs().max()
    x = torch.randn(3, 64, requires_grad=True)
    out = q(x)
    torch.testing.assert_close(out, F.linear(x, w, linear.bias), rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad @ w, rtol=1e-6, atol=1e-6)
    assert not any(p.requires_grad for p in q.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = q(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32


def test_qlora_trains_on_cpu_with_a_frozen_nf4_base(tiny_model, tokens):
    model = tiny_model()
    apply_peft(
        model, PeftConfig(method="qlora", r=8, alpha=16, targets=["attn.wqkv", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2"])
    )
    quantized = [m for m in model.modules() if isinstance(m, NF4Linear)]
    assert len(quantized) == 5 * model.cfg.n_layers  # wqkv, wo, w1, w3, w2
    assert all(m.lora_A.dtype == torch.bfloat16 for m in lora_modules(model).values())
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    opt = torch.optim.AdamW([p for _, p in trainable_parameters(model)], lr=1e-2)
    model.train()
    losses = []
    for _ in range(15):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as the trainer runs it
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]
    for k, v in model.state_dict().items():
        if k in frozen:
            assert torch.equal(v, frozen[k]), k


def test_qlora_merged_weights_and_kiln_format_round_trip(tiny_model, tokens, fill_peft, tmp_path):
    model = tiny_model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = PeftConfig(method="qlora", r=4, lora_dtype="float32", targets=["attn.wqkv", "ffn.w2", "output"])
    fill_peft(apply_peft(model, cfg))
    with pytest.raises(ValueError, match="4-bit"):
        merge_lora(model)
    with torch.no_grad():
        logits = model(tokens)
    # Full-precision merged weights reproduce the QLoRA model in a plain Transformer.
    plain = tiny_model()
    plain.load_state_dict(merged_state_dict(model))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), logits, rtol=1e-4, atol=1e-4)
    base = base_state_dict(model)
    assert set(base) == set(original)
    assert (base["layers.0.ffn.w3.weight"] - original["layers.0.ffn.w3.weight"]).abs().max() > 0  # dequantised
    torch.testing.assert_close(base["output.weight"], original["output.weight"], rtol=0, atol=0)  # never quantised
    # Re-quantising the same base is deterministic: the adapter file alone restores the model.
    save_trainable(model, cfg, tmp_path)
    fresh = tiny_model()
    fresh.load_state_dict(original)
    load_trainable(fresh, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), logits, rtol=0, atol=0)
    # A checkpoint of the quantised model reloads as well.
    again = apply_peft(tiny_model(), cfg)
    again.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), logits, rtol=0, atol=0)
