"""Kept activations per token per layer, measured (saved_tensors_hooks, plus the storages the forward
still holds: selective checkpointing's cache) against the formula in kiln.model.activations
(Korthikanti et al. 2022, term by term for Kiln's block), without, with selective and with full
activation checkpointing."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from kiln.model import ModelConfig, build_model
from kiln.model.activations import layer_activation_bytes_per_token, measured_layer_activation_bytes_per_token
from kiln.model.norm import RMSNorm
from kiln.parallel.parallelize import apply_activation_checkpointing
from kiln.train.precision import autocast

SEQ = 32


def config(**overrides) -> ModelConfig:
    base = dict(vocab_size=61, dim=128, n_layers=1, n_heads=8, n_kv_heads=2, max_seq_len=SEQ)
    return ModelConfig(**{**base, **overrides})


def measure(cfg: ModelConfig, precision: str, mode: str) -> float:
    def build(n_layers: int):
        model = build_model(dataclasses.replace(cfg, n_layers=n_layers))
        apply_activation_checkpointing(model, mode)
        return model

    return measured_layer_activation_bytes_per_token(build, SEQ, cfg.vocab_size, lambda: autocast(precision))


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("precision,value_bytes", [("fp32", 4), ("bf16", 2)])
def test_saved_bytes_match_formula(precision, value_bytes, mode):
    cfg = config()
    got = measure(cfg, precision, mode)
    want = layer_activation_bytes_per_token(cfg, value_bytes, mode)
    assert got == pytest.approx(want, rel=0.01), (got / cfg.dim, want / cfg.dim)


@pytest.mark.parametrize(
    "overrides", [{"ffn": "gelu"}, {"qkv_bias": True}, {"qk_norm": True}], ids=["gelu", "qkv_bias", "qk_norm"]
)
def test_selective_bytes_match_formula_across_blocks(overrides):
    # GELU has one up-projection (w1) where SwiGLU has w1 and w3; a qkv bias makes wqkv an addmm.
    cfg = config(**overrides)
    got = measure(cfg, "bf16", "selective")
    assert got == pytest.approx(layer_activation_bytes_per_token(cfg, 2, "selective"), rel=0.01), got / cfg.dim


@pytest.mark.parametrize(
    "overrides",
    [{"n_kv_heads": 0}, {"ffn": "gelu"}, {"pos": "learned"}, {"qkv_bias": True}, {"qk_norm": True}],
    ids=["mha", "gelu", "learned", "qkv_bias", "qk_norm"],
)
def test_saved_bytes_match_formula_across_blocks(overrides):
    cfg = config(**overrides)
    assert measure(cfg, "bf16", "none") == pytest.approx(layer_activation_bytes_per_token(cfg, 2), rel=0.01)


def test_formula_worked_numbers():
    # h=128, a=8, kv=2, SwiGLU f=384 (ffn_hidden_size): 2*(6*128 + 2*128*2/8 + 4*384) + 4*8 + 8.
    cfg = config()
    assert cfg.ffn_hidden_size == 384
    assert layer_activation_bytes_per_token(cfg, 2) == 2 * (768 + 64 + 1536) + 40 == 4776
    # A GPT-style block (MHA, GELU with f = 4h) in 16-bit: Korthikanti's 34h less the two 1-byte
    # dropout masks, plus the logsumexp (4 bytes per head) and the two RMS statistics.
    gpt = config(n_kv_heads=0, ffn="gelu", ffn_hidden=4 * 128)
    assert layer_activation_bytes_per_token(gpt, 2) == (34 - 2) * 128 + 4 * 8 + 8
    assert layer_activation_bytes_per_token(gpt, 2, "full") == 4 * 128
    # Selective: the float32 block input 4h, wqkv's output 2*(h + 2h*kv/a), SDPA's output 2h and
    # logsumexp 4a, w1's and w3's outputs 2*2f.
    assert layer_activation_bytes_per_token(cfg, 2, "selective") == 512 + 2 * (128 + 64) + 256 + 32 + 4 * 384 == 2720
    assert layer_activation_bytes_per_token(cfg, 2, "selective", residual_bytes=2) == 2720 - 256


def test_formula_refuses_blocks_it_does_not_describe():
    with pytest.raises(ValueError, match="dense RMSNorm"):
        layer_activation_bytes_per_token(config(norm="layernorm"), 2)
    with pytest.raises(ValueError, match="dense RMSNorm"):
        layer_activation_bytes_per_token(config(moe_every=1), 2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rmsnorm_matches_torch_forward_and_backward(precision):
    torch.manual_seed(0)
    ours, reference = RMSNorm(48, eps=1e-6), nn.RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        reference.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 48, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    grad = torch.randn(3, 5, 48)
    with autocast(precision):
        out = ours(x)
        out_ref = reference(x_ref)
    low = precision == "bf16"
    assert out.dtype == (torch.bfloat16 if low else torch.float32)
    torch.testing.assert_close(out.float(), out_ref.to(out.dtype).float(), rtol=0, atol=0)
    out.float().backward(grad)
    out_ref.backward(grad)
    # Under bf16 backward reads the input rounded to bf16 (what the matmuls already see).
    tol = dict(rtol=2e-2, atol=2e-2) if low else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(ours.weight.grad, reference.weight.grad, **tol)
    assert x.grad.dtype == torch.float32 and ours.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("n_kv_heads", [0, 2], ids=["mha", "gqa"])
def test_qk_norm_bytes_match_formula_in_fp32(n_kv_heads):
    # fp32 and MHA separate the b*h(1 + kv/a) inputs from the 4*(a + kv) float32 statistics.
    cfg = config(qk_norm=True, n_kv_heads=n_kv_heads)
    assert measure(cfg, "fp32", "none") == pytest.approx(layer_activation_bytes_per_token(cfg, 4), rel=0.01)
