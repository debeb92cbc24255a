"""RoPE scaling (linear, dynamic NTK, YaRN, llama3) against transformers' own implementation."""

import dataclasses

import pytest
import torch

from kiln.config import build
from kiln.errors import ConfigError
from kiln.model import ModelConfig
from kiln.model.config import RopeScaling
from kiln.model.rope import rope_tables
from kiln.model.weights import model_config_from_dict

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

HEAD_DIM, THETA, ORIGINAL = 32, 10000.0, 32

# (Kiln's scaling, transformers' rope_parameters, transformers' max_position_embeddings): the
# dynamic type reads max_position_embeddings as its original context, the others as the extended one.
CASES = {
    "linear": (RopeScaling("linear", 4.0), {"rope_type": "linear", "factor": 4.0}, 4 * ORIGINAL),
    "dynamic": (RopeScaling("dynamic", 4.0, ORIGINAL), {"rope_type": "dynamic", "factor": 4.0}, ORIGINAL),
    "yarn": (
        RopeScaling("yarn", 4.0, ORIGINAL),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
        4 * ORIGINAL,
    ),
    "yarn-deepseek": (
        RopeScaling(
            "yarn", 8.0, ORIGINAL, beta_fast=16.0, beta_slow=2.0, mscale=1.0, mscale_all_dim=0.5, truncate=False
        ),
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": ORIGINAL,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "truncate": False,
        },
        8 * ORIGINAL,
    ),
    "llama3": (
        RopeScaling("llama3", 8.0, ORIGINAL, low_freq_factor=1.0, high_freq_factor=4.0),
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": ORIGINAL,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        4 * ORIGINAL,
    ),
}


def hf_tables(rope_parameters: dict, max_position_embeddings: int, n: int):
    config = transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={**rope_parameters, "rope_theta": THETA},
    )
    rotary = LlamaRotaryEmbedding(config)  # fresh: a dynamic one has seen no longer sequence
    cos, sin = rotary(torch.zeros(1), torch.arange(n)[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("multiple", [1, 5])
def test_tables_match_transformers_beyond_the_original_context(name, multiple):
    scaling, params, max_pos = CASES[name]
    n = multiple * ORIGINAL  # within the original context, and 5x past it
    cos, sin = hf_tables(params, max_pos, n)
    ours_cos, ours_sin = rope_tables(HEAD_DIM, n, THETA, scaling=scaling, seq_len=n)
    # transformers computes in float32, whose angle rounding at position 160 is a few 1e-6.
    torch.testing.assert_close(ours_cos, cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_sin, sin, rtol=0, atol=1e-5)


def test_every_type_changes_the_tables_past_the_original_context():
    plain = rope_tables(HEAD_DIM, 5 * ORIGINAL, THETA)[0]
    for name, (scaling, _, _) in CASES.items():
        scaled = rope_tables(HEAD_DIM, 5 * ORIGINAL, THETA, scaling=scaling, seq_len=5 * ORIGINAL)[0]
        assert (scaled - plain).abs().max() > 0.1, name


def test_dynamic_is_plain_rope_up_to_the_original_context():
    scaling = CASES["dynamic"][0]
    plain = rope_tables(HEAD_DIM, ORIGINAL, THETA)
    for got, want in zip(rope_tables(HEAD_DIM, ORIGINAL, THETA, scaling=scaling, seq_len=ORIGINAL), plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def model_cfg(**scaling) -> ModelConfig:
    return ModelConfig(vocab_size=64, dim=64, n_heads=2, max_seq_len=128, rope_scaling=RopeScaling(**scaling))


@pytest.mark.parametrize(
    "scaling,key",
    [
        ({"type": "ntk", "factor": 2.0}, "rope_scaling.type"),
        ({"type": "linear", "factor": 0.5}, "rope_scaling.factor"),
        ({"type": "linear", "factor": 2.0, "original_max_seq_len": 64}, "rope_scaling.original_max_seq_len"),
        ({"type": "yarn", "factor": 4.0}, "rope_scaling.original_max_seq_len"),
        ({"type": "yarn", "factor": 4.0, "original_max_seq_len": 256}, "rope_scaling.original_max_seq_len"),
        ({"type": "yarn", "factor": 4.0, "original_max_seq_len": 32, "low_freq_factor": 1.0}, "low_freq_factor"),
        ({"type": "llama3", "factor": 8.0, "original_max_seq_len": 32, "beta_fast": 8.0}, "rope_scaling.beta_fast"),
        ({"type": "llama3", "factor": 8.0, "original_max_seq_len": 32, "high_freq_factor": 0.5}, "high_freq_factor"),
        ({"type": "yarn", "factor": 4.0, "original_max_seq_len": 32, "beta_slow": 64.0}, "rope_scaling.beta_fast"),
        ({"type": "yarn", "factor": 4.0, "original_max_seq_len": 32, "attention_factor": 0.0}, "attention_factor"),
        ({"type": "dynamic", "factor": 2.0, "original_max_seq_len": 32, "truncate": False}, "rope_scaling.truncate"),
    ],
)
def test_bad_scaling_is_refused_naming_the_key(scaling, key):
    with pytest.raises(ConfigError, match=key):
        model_cfg(**scaling).validate()


def test_recipe_table_builds_and_checkpoint_dict_round_trips():
    table = {"dim": 64, "n_heads": 2, "max_seq_len": 1024, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    table["rope_scaling"]["original_max_seq_len"] = 256
    cfg = build(ModelConfig, table, "model")
    assert cfg.rope_scaling == RopeScaling("yarn", 4.0, 256)
    cfg.validate()
    assert model_config_from_dict(dataclasses.asdict(cfg), "manifest") == cfg
    with pytest.raises(ConfigError, match="model.rope_scaling.scale: unknown key"):
        build(ModelConfig, {"rope_scaling": {"type": "linear", "scale": 2.0}}, "model")
    with pytest.raises(ConfigError, match="rope_scaling: scales RoPE"):
        dataclasses.replace(model_cfg(type="linear", factor=2.0), pos="learned").validate()


def test_dynamic_refuses_context_parallelism():
    from kiln.model import build_model
    from kiln.parallel.context import apply_context_parallel

    model = build_model(model_cfg(type="dynamic", factor=2.0, original_max_seq_len=32))
    with pytest.raises(ConfigError, match="model.rope_scaling.type: 'dynamic' cannot train with context"):
        apply_context_parallel(model, None)
