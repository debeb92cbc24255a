"""Scaled RoPE through `kiln import hf` / `kiln export hf`: logits equal transformers' past the
original context, and the configs round-trip."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from kiln_testing.hf_llama import hf_llama  # noqa: E402
from kiln_testing.models import randomise  # noqa: E402

from kiln.errors import DataError  # noqa: E402
from kiln.hf import export_hf, import_hf  # noqa: E402
from kiln.model import ModelConfig, build_model  # noqa: E402
from kiln.model.config import RopeScaling  # noqa: E402

ORIGINAL, LONG = 32, 128  # sequences of 4x the original context

# transformers' rope_parameters and max_position_embeddings, and the RopeScaling import gives.
SCALED = {
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": ORIGINAL},
        {"low_freq_factor": 1.0, "high_freq_factor": 2.0},
        LONG,
    ),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}, {}, LONG),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {}, LONG),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, {}, ORIGINAL),
}


TOKENS = torch.randint(0, 320, (2, LONG), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(SCALED))
def test_import_matches_transformers_logits_past_the_original_context(tmp_path, name):
    rope, extra, max_pos = SCALED[name]
    hf = hf_llama({**rope, **extra}, max_pos)
    hf.save_pretrained(tmp_path)
    cfg, state = import_hf(tmp_path)
    assert cfg.rope_scaling.type == name and cfg.max_seq_len == LONG
    assert cfg.rope_scaling.original_max_seq_len == (0 if name == "linear" else ORIGINAL)
    model = build_model(cfg)
    model.load_state_dict(state)
    with torch.no_grad():
        expected = hf(TOKENS).logits  # a fresh model: dynamic scales for this length
        torch.testing.assert_close(model(TOKENS), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "scaling",
    [
        RopeScaling("yarn", 4.0, ORIGINAL, beta_fast=16.0, attention_factor=1.3),
        RopeScaling("llama3", 8.0, ORIGINAL, low_freq_factor=2.0, high_freq_factor=8.0),
        RopeScaling("dynamic", 4.0, ORIGINAL),
    ],
)
def test_export_loads_in_transformers_and_imports_back(tmp_path, scaling):
    cfg = ModelConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, max_seq_len=LONG, rope_theta=500.0)
    cfg.rope_scaling = scaling
    model = randomise(build_model(cfg)).eval()
    export_hf(cfg, model.state_dict(), None, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"] == {**scaling.hf_parameters(), "rope_theta": 500.0}
    assert config["rope_scaling"] == scaling.hf_parameters()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, model(TOKENS), rtol=1e-4, atol=1e-4)
    back, _ = import_hf(tmp_path)
    assert back.rope_scaling.hf_parameters() == scaling.hf_parameters()
    assert back.max_seq_len == cfg.max_seq_len


def test_import_refuses_what_it_cannot_represent(tmp_path):
    hf_llama(*SCALED["yarn"][::2]).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for rope, match in [
        ({"rope_type": "longrope", "factor": 4.0}, "'longrope' is not supported"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "extra": 1}, "extra"),
        ({"rope_type": "linear", "factor": 4.0, "beta_fast": 8}, "beta_fast: is not read by rope_type 'linear'"),
        ({"rope_type": "yarn", "factor": "4"}, "factor: must be a number"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": rope, "rope_scaling": None}))
        with pytest.raises(DataError, match=match):
            import_hf(tmp_path)
