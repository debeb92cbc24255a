"""The planner's KILN activation model counts what Kiln's blocks keep: kiln.model.activations' formula
(measured against saved_tensors_hooks and selective checkpointing's cache in
tests/model/test_activation_memory.py), for every checkpointing mode, under bf16 autocast."""

import dataclasses

import pytest

from kiln.model import ModelConfig
from kiln.model.activations import layer_activation_bytes_per_token
from kiln.parallel.plan import KILN, MEGATRON, Layout, Workload, layer_activation_bytes, memory

SHAPES = {
    "gqa-swiglu": ModelConfig(vocab_size=256, dim=512, n_layers=4, n_heads=8, n_kv_heads=2),
    "mha-gelu": ModelConfig(vocab_size=256, dim=256, n_layers=4, n_heads=4, ffn="gelu", ffn_hidden=1024),
    "llama-like": ModelConfig(vocab_size=256, dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_hidden=14336),
    "qk-norm": ModelConfig(vocab_size=256, dim=512, n_layers=4, n_heads=8, n_kv_heads=2, qk_norm=True),
}


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_planner_agrees_with_the_measured_formula(name, mode):
    cfg = SHAPES[name]
    tokens = 4096
    want = layer_activation_bytes_per_token(cfg, 2, mode) * tokens
    assert layer_activation_bytes(cfg, 2048, tokens, 1, mode, KILN) == want
    # With FSDP's bf16 weights the residual stream, which checkpointing keeps, is bf16.
    bf16_stream = layer_activation_bytes_per_token(cfg, 2, mode, residual_bytes=2) * tokens
    assert layer_activation_bytes(cfg, 2048, tokens, 1, mode, KILN, residual_bytes=2) == bf16_stream


def test_memory_counts_the_residual_dtype_of_the_layout():
    cfg = SHAPES["gqa-swiglu"]
    work = Workload(2048, 8 * 2048)
    ddp = memory(cfg, Layout(dp_replicate=8, ac="full"), work)
    fsdp = memory(cfg, Layout(dp_shard=8, zero=3, ac="full"), work)
    per_layer = {r: layer_activation_bytes(cfg, 2048, 2048, 1, "full", KILN, residual_bytes=r) for r in (2, 4)}
    rematerialised = layer_activation_bytes(cfg, 2048, 2048, 1, "none", KILN)
    assert ddp.activations == pytest.approx(cfg.n_layers * per_layer[4] + rematerialised)
    assert fsdp.activations == pytest.approx(cfg.n_layers * per_layer[2] + rematerialised)


def test_selective_keeps_between_none_and_full_and_megatron_is_unchanged():
    cfg = dataclasses.replace(SHAPES["llama-like"], n_layers=1)
    none, selective, full = (layer_activation_bytes(cfg, 2048, 1, 1, m) for m in ("none", "selective", "full"))
    assert none > selective > full
    # Megatron's selective recomputation drops only the attention scores (Korthikanti et al. 2022).
    scores = layer_activation_bytes(cfg, 2048, 1, 1, "none", MEGATRON) - layer_activation_bytes(
        cfg, 2048, 1, 1, "selective", MEGATRON
    )
    assert scores == pytest.approx(cfg.n_heads * 2048 * 5)


def test_planner_selective_moe_layer_is_what_the_model_keeps():
    # In an MoE block the every-other-matmul rule keeps the float32 router logits and each expert's
    # down-projection output; the planner's count of that is checked against the measurement.
    from kiln.model import build_model
    from kiln.model.activations import measured_layer_activation_bytes_per_token
    from kiln.parallel.parallelize import apply_activation_checkpointing
    from kiln.train.precision import autocast

    cfg = ModelConfig(
        vocab_size=61, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16,
        moe_every=1, n_experts=4, moe_top_k=2, moe_hidden=32, moe_shared_expert=True,
    )  # fmt: skip

    def build(n_layers):
        model = build_model(dataclasses.replace(cfg, n_layers=n_layers))
        apply_activation_checkpointing(model, "selective")
        return model

    measured = measured_layer_activation_bytes_per_token(build, 16, cfg.vocab_size, lambda: autocast("bf16"))
    assert layer_activation_bytes(cfg, 16, 1, 1, "selective", KILN, moe=True) == pytest.approx(measured, rel=1e-6)
