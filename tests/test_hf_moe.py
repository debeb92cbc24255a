"""MoE models to and from Hugging Face Mixtral / Qwen2-MoE (kiln/hf_moe.py), checked against transformers."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from kiln_testing.models import randomise  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

from kiln.checkpoint import save_weights  # noqa: E402
from kiln.errors import ConfigError, DataError  # noqa: E402
from kiln.hf import export_checkpoint_to_hf, export_hf, import_hf, import_hf_to_checkpoint  # noqa: E402
from kiln.model import ModelConfig, build_model  # noqa: E402
from kiln.model.moe import moe_layers  # noqa: E402

TOKENS = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(0))
# Expert width differs from the dense width, so a swapped intermediate size cannot load.
BASE = dict(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, rope_theta=500.0)
BASE.update(ffn_hidden=96, n_experts=4, moe_top_k=2, moe_hidden=32)


def kiln_model(**overrides):
    torch.manual_seed(0)
    return randomise(build_model(ModelConfig(**{**BASE, **overrides}))).eval()


def check_logits(kiln, hf):
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, kiln(TOKENS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "overrides,hf_class",
    [
        ({"moe_every": 1}, "MixtralForCausalLM"),
        ({"moe_every": 1, "moe_norm_topk": False}, "Qwen2MoeForCausalLM"),
        ({"moe_every": 1, "moe_top_k": 1, "moe_norm_topk": False}, "Qwen2MoeForCausalLM"),
        ({"moe_every": 2, "n_layers": 3}, "Qwen2MoeForCausalLM"),  # first layer dense
        ({"moe_layers": [0], "moe_shared_expert": True, "qkv_bias": True}, "Qwen2MoeForCausalLM"),
        ({"moe_every": 1, "moe_shared_expert": True, "tie_embeddings": True}, "Qwen2MoeForCausalLM"),
    ],
)
def test_export_matches_transformers_logits(tmp_path, overrides, hf_class):
    model = kiln_model(**overrides)
    export_hf(model.cfg, model.state_dict(), None, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == hf_class
    check_logits(model, hf)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_experts_per_tok"] == model.cfg.moe_top_k
    if hf_class == "Qwen2MoeForCausalLM":
        assert config["norm_topk_prob"] == model.cfg.moe_norm_topk
        sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
        assert sparse == [i for i in range(model.cfg.n_layers) if model.cfg.is_moe_layer(i)]


def hf_moe_model(kind, **extra):
    # The sizes of BASE under HF's names; the eps and RoPE base differ from Kiln's defaults, so an
    # import that ignored them would not match.
    names = dict(
        vocab_size="vocab_size", hidden_size="dim", num_hidden_layers="n_layers", num_attention_heads="n_heads"
    )
    names.update(
        num_key_value_heads="n_kv_heads", max_position_embeddings="max_seq_len", num_experts_per_tok="moe_top_k"
    )
    common = {hf_key: BASE[key] for hf_key, key in names.items()} | dict(rms_norm_eps=1e-6, rope_theta=1000.0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**{**common, "intermediate_size": 48, "num_local_experts": 4, **extra})
        model_cls = transformers.MixtralForCausalLM
    else:
        sizes = dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, shared_expert_intermediate_size=0)
        config = transformers.Qwen2MoeConfig(**{**common, **sizes, **extra})
        model_cls = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(0)
    model = randomise(model_cls(config)).eval()
    for layer in model.model.layers:
        if hasattr(layer.mlp, "shared_expert_gate"):
            layer.mlp.shared_expert_gate.weight.data.zero_()  # Kiln's shared expert is ungated
    return model


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("mixtral", {}),
        ("qwen2_moe", {"norm_topk_prob": True}),
        ("qwen2_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3}),
        ("qwen2_moe", {"mlp_only_layers": [0], "shared_expert_intermediate_size": 32}),
        ("qwen2_moe", {"qkv_bias": False, "norm_topk_prob": True}),
    ],
)
def test_import_matches_transformers_and_exports_back(tmp_path, kind, extra):
    hf = hf_moe_model(kind, **extra)
    hf.save_pretrained(tmp_path / "hf")
    cfg, state = import_hf(tmp_path / "hf")
    model = build_model(cfg)
    model.load_state_dict(state)  # strict: every Kiln tensor is present and nothing extra
    check_logits(model.eval(), hf)
    assert (len(moe_layers(model)), cfg.moe_z_loss_weight, cfg.moe_capacity_factor) == (
        sum(hasattr(layer.mlp, "experts") for layer in hf.model.layers),
        0.0,
        0.0,
    )
    export_hf(cfg, state, None, tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits, rtol=1e-5, atol=1e-5)


def test_checkpoint_verbs_round_trip_a_moe_model(tmp_path):
    """`kiln export hf` then `kiln import hf` (the functions behind the verbs) give identical logits."""
    model = kiln_model(moe_every=2, n_layers=3, moe_shared_expert=True)
    save_weights(tmp_path / "ckpt", model.cfg, model.state_dict(), {"step": 1})
    export_checkpoint_to_hf(tmp_path / "ckpt", None, tmp_path / "hf")
    back = import_hf_to_checkpoint(tmp_path / "hf", tmp_path / "back")
    cfg, state = import_hf(tmp_path / "hf")
    assert (cfg.moe_every, cfg.moe_shared_expert, cfg.moe_hidden) == (2, True, 32)
    reloaded = build_model(cfg)
    reloaded.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(TOKENS), model(TOKENS), rtol=0, atol=0)
    assert (back / "model.safetensors").is_file()


@pytest.mark.parametrize("kind,n_layers", [("qwen2_moe", 2), ("mixtral", 1)])
def test_hf_training_aux_loss_equals_kilns_for_one_moe_layer(tmp_path, kind, n_layers):
    overrides = {"moe_layers": [1]} if kind == "qwen2_moe" else {"moe_every": 1, "n_layers": 1}
    model = kiln_model(moe_aux_loss_weight=0.03, **overrides)
    export_hf(model.cfg, model.state_dict(), None, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.model_type == kind and hf.config.output_router_logits
    with torch.no_grad():
        model(TOKENS)
        out = hf(TOKENS, labels=TOKENS)
    (layer,) = moe_layers(model)
    kiln_term = layer.aux_loss_weight * layer.aux_loss
    torch.testing.assert_close(hf.config.router_aux_loss_coef * out.aux_loss, kiln_term, rtol=1e-5, atol=0)


def test_per_layer_aux_loss_is_hf_formula_over_top_k_and_coef_scales_with_layers(tmp_path):
    model = kiln_model(moe_every=1, moe_top_k=2, moe_aux_loss_weight=0.01)
    export_hf(model.cfg, model.state_dict(), None, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        model(TOKENS)
        router_logits = hf(TOKENS, output_router_logits=True).router_logits
    for layer, logits in zip(moe_layers(model), router_logits, strict=True):
        hf_aux = load_balancing_loss_func((logits,), num_experts=4, top_k=2)
        torch.testing.assert_close(hf_aux, 2 * layer.aux_loss, rtol=1e-5, atol=0)
    # 2 MoE layers, top-2: both losses give 0.01 * 2 at perfect balance (HF's pooled loss is k there).
    assert hf.config.router_aux_loss_coef == pytest.approx(0.01 * 2 / 2)


def test_export_refuses_capacity_drops(tmp_path):
    model = kiln_model(moe_every=1, moe_capacity_factor=1.25)
    with pytest.raises(ConfigError, match="moe_capacity_factor.*dropless"):
        export_hf(model.cfg, model.state_dict(), None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_refuses_what_kilns_moe_cannot_compute(tmp_path):
    hf = hf_moe_model("qwen2_moe", shared_expert_intermediate_size=32)
    hf.model.layers[0].mlp.shared_expert_gate.weight.data.fill_(0.1)
    hf.save_pretrained(tmp_path / "gated")
    with pytest.raises(DataError, match="shared_expert_gate.weight is not zero"):
        import_hf(tmp_path / "gated")
    hf_moe_model("qwen2_moe", shared_expert_intermediate_size=48).save_pretrained(tmp_path / "wide")
    with pytest.raises(DataError, match="shared_expert_intermediate_size=48"):
        import_hf(tmp_path / "wide")
    hf_moe_model("mixtral", router_jitter_noise=0.1).save_pretrained(tmp_path / "jitter")
    with pytest.raises(DataError, match="router_jitter_noise=0.1"):
        import_hf(tmp_path / "jitter")
