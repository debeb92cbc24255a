"""Kiln LoRA adapters against the real `peft` library on the model kiln.hf.export_hf writes."""

import json
import os

import pytest
import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # peft imports torchao when installed
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors import safe_open  # noqa: E402

from kiln.errors import DataError  # noqa: E402
from kiln.hf import export_hf  # noqa: E402
from kiln.peft import (  # noqa: E402
    PeftConfig,
    apply_peft,
    base_state_dict,
    load_peft_adapter,
    lora_modules,  # noqa: E402
    save_peft_adapter,
)

ALL = ["attn.wqkv", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2", "output"]


def hf_logits(model_dir, adapter_dir, tokens):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if adapter_dir is not None:
        hf = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.parametrize(
    "overrides,peft_cfg",
    [
        ({"n_kv_heads": 0}, PeftConfig(method="lora", r=4, alpha=8, targets=ALL)),
        ({"n_kv_heads": 2}, PeftConfig(method="lora", r=4, alpha=8, rslora=True, targets=["attn.wqkv", "attn.wo"])),
        (
            {"n_kv_heads": 1, "qkv_bias": True},
            PeftConfig(method="lora", r=2, alpha=5, targets=["attn.wqkv", "ffn.w1", "ffn.w3"]),
        ),
        ({"n_kv_heads": 2}, PeftConfig(method="qlora", r=4, alpha=8, lora_dtype="float32", targets=ALL)),
    ],
)
def test_peft_loads_a_kiln_adapter_onto_the_exported_model(
    tmp_path, tiny_model, tokens, fill_peft, overrides, peft_cfg
):
    model = fill_peft(apply_peft(tiny_model(**overrides), peft_cfg))
    with torch.no_grad():
        kiln_logits = model(tokens)
    # For QLoRA the exported base is the dequantised NF4 weights the Kiln forward computes with.
    export_hf(model.cfg, base_state_dict(model), None, tmp_path / "hf")
    save_peft_adapter(model, model.cfg, tmp_path / "adapter", peft_cfg)

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"]) == (
        "LORA",
        peft_cfg.r,
        peft_cfg.alpha,
        peft_cfg.rslora,
    )
    expected_targets = {
        "attn.wqkv": ["q_proj", "k_proj", "v_proj"],
        "attn.wo": ["o_proj"],
        "ffn.w1": ["gate_proj"],
        "ffn.w3": ["up_proj"],
        "ffn.w2": ["down_proj"],
        "output": ["lm_head"],
    }
    assert sorted(config["target_modules"]) == sorted(p for t in peft_cfg.targets for p in expected_targets[t])
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in keys
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in keys)

    base = hf_logits(tmp_path / "hf", None, tokens)
    assert (base - kiln_logits).abs().max() > 0.1  # the adapter matters
    torch.testing.assert_close(
        hf_logits(tmp_path / "hf", tmp_path / "adapter", tokens), kiln_logits, rtol=1e-4, atol=1e-4
    )

    # And back: the adapter file alone restores the Kiln model, as rank-r LoRAs sharing one A.
    fresh = tiny_model(**overrides)
    fresh.load_state_dict(base_state_dict(model))
    load_peft_adapter(fresh, tmp_path / "adapter")
    assert {n: m.r for n, m in lora_modules(fresh).items()} == {n: m.r for n, m in lora_modules(model).items()}
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), kiln_logits, rtol=1e-5, atol=1e-5)


def test_a_peft_trained_adapter_loads_into_kiln_and_saves_back(tmp_path, tiny_model, tokens):
    """An adapter made by `peft` itself: separate A per projection, only some projections, a rank and
    an alpha that differ per module. Kiln stacks the parts into one LoRA per fused layer."""
    model = tiny_model()
    export_hf(model.cfg, model.state_dict(), None, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    lora_cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
        rank_pattern={"gate_proj": 2},
        alpha_pattern={"v_proj": 32},
    )
    pm = peft.get_peft_model(hf, lora_cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    pm.save_pretrained(tmp_path / "theirs")
    pm.eval()
    with torch.no_grad():
        expected = pm(tokens).logits

    loads_with_peft_logits_and_saves_back(model, tmp_path, tokens, expected)
    ranks = {n: m.r for n, m in lora_modules(model).items()}
    assert (
        ranks["layers.0.attn.wqkv"] == 8
        and ranks["layers.0.ffn.w1"] == 2
        and ranks["layers.0.ffn.w3"] == 4
        and ranks["layers.0.ffn.w2"] == 4
    )


def loads_with_peft_logits_and_saves_back(model, tmp_path, tokens, expected) -> None:
    """`peft`'s adapter in tmp_path/theirs loads into `model` with peft's logits, and the adapter Kiln
    saves from it gives peft the same logits on the exported base in tmp_path/hf."""
    load_peft_adapter(model, tmp_path / "theirs")
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, rtol=1e-4, atol=1e-4)
    save_peft_adapter(model, model.cfg, tmp_path / "ours")
    torch.testing.assert_close(hf_logits(tmp_path / "hf", tmp_path / "ours", tokens), expected, rtol=1e-4, atol=1e-4)


def test_unsupported_adapters_are_refused_clearly(tmp_path, tiny_model, fill_peft):
    model = tiny_model()
    export_hf(model.cfg, model.state_dict(), None, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    dora = peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
    peft.get_peft_model(hf, dora).save_pretrained(tmp_path / "dora")
    with pytest.raises(DataError, match="use_dora"):
        load_peft_adapter(tiny_model(), tmp_path / "dora")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["embed_tokens"])).save_pretrained(tmp_path / "emb")
    with pytest.raises(DataError, match="embed_tokens"):
        load_peft_adapter(tiny_model(), tmp_path / "emb")
    moe = fill_peft(
        apply_peft(
            tiny_model(moe_every=1, n_experts=2, moe_top_k=1, moe_shared_expert=True),
            PeftConfig(method="lora", r=2, targets=["shared_expert.w1"]),
        )
    )
    with pytest.raises(ValueError, match="no counterpart"):
        save_peft_adapter(moe, moe.cfg, tmp_path / "moe")


def _peft_lm_head_adapter(tmp_path, model, tokens):
    """A LoRA that `peft` trains on q_proj and lm_head and saves with its defaults, which store a
    copy of the base lm_head weight too (save_embedding_layers="auto"); and peft's logits."""
    export_hf(model.cfg, model.state_dict(), None, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    with pytest.warns(UserWarning, match="save_embedding_layers"):
        pm.save_pretrained(tmp_path / "theirs")
    with torch.no_grad():
        return pm.eval()(tokens).logits


def test_a_peft_lm_head_adapter_with_its_saved_base_weight_loads_and_saves_back(tmp_path, tiny_model, tokens):
    model = tiny_model()
    expected = _peft_lm_head_adapter(tmp_path, model, tokens)
    with safe_open(str(tmp_path / "theirs" / "adapter_model.safetensors"), "pt") as f:
        assert "base_model.model.lm_head.base_layer.weight" in set(f.keys())  # the copy peft adds

    loads_with_peft_logits_and_saves_back(model, tmp_path, tokens, expected)
    assert set(lora_modules(model)) == {"output", "layers.0.attn.wqkv", "layers.1.attn.wqkv"}


def test_a_saved_base_weight_that_differs_from_the_model_is_refused(tmp_path, tiny_model, tokens):
    model = tiny_model()
    _peft_lm_head_adapter(tmp_path, model, tokens)
    other = tiny_model()
    with torch.no_grad():
        other.output.weight.add_(1e-3)  # the adapter was saved on other lm_head weights
    with pytest.raises(DataError, match=r"adapter_model\.safetensors: base_model\.model\.lm_head\.base_layer\.weight"):
        load_peft_adapter(other, tmp_path / "theirs")


def test_a_kiln_adapter_written_for_the_fused_w13_loads_onto_w1_and_w3(tmp_path, tiny_model, tokens, fill_peft):
    """A version-1 Kiln adapter file (written when gate and up were one fused `ffn.w13`, rows
    interleaved) loads as LoRAs on w1 and w3 giving the same logits."""
    from kiln.checkpoint import read_safetensors, write_safetensors
    from kiln.peft.peft_io import KILN_CONFIG, KILN_WEIGHTS, load_trainable, save_trainable

    torch.manual_seed(0)
    base = tiny_model()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    cfg = PeftConfig(method="lora", r=2, alpha=4, targets=["attn.wqkv", "ffn.w1", "ffn.w3"])
    model = fill_peft(apply_peft(base, cfg))
    with torch.no_grad():
        for i in range(model.cfg.n_layers):  # the fused LoRA had one A for gate and up
            model.get_submodule(f"layers.{i}.ffn.w3").lora_A.copy_(model.get_submodule(f"layers.{i}.ffn.w1").lora_A)
        expected = model(tokens)
    save_trainable(model, cfg, tmp_path)
    meta = json.loads((tmp_path / KILN_CONFIG).read_text())
    tensors = read_safetensors(tmp_path / KILN_WEIGHTS)
    meta["version"], meta["peft"]["targets"] = 1, ["attn.wqkv", "ffn.w13"]
    for i in range(model.cfg.n_layers):
        stem = f"layers.{i}.ffn"
        info = meta["lora"].pop(f"{stem}.w1")
        del meta["lora"][f"{stem}.w3"]
        meta["lora"][f"{stem}.w13"] = info
        gate, up = tensors.pop(f"{stem}.w1.lora_B"), tensors.pop(f"{stem}.w3.lora_B")
        tensors[f"{stem}.w13.lora_A"] = tensors.pop(f"{stem}.w1.lora_A")
        del tensors[f"{stem}.w3.lora_A"]
        tensors[f"{stem}.w13.lora_B"] = torch.stack([gate, up], dim=1).flatten(0, 1)
    write_safetensors(tensors, tmp_path / KILN_WEIGHTS)
    (tmp_path / KILN_CONFIG).write_text(json.dumps(meta))

    fresh = tiny_model()
    fresh.load_state_dict(base_state)
    loaded = load_trainable(fresh, tmp_path)
    assert loaded.targets == ["attn.wqkv", "ffn.w1", "ffn.w3"]
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), expected, rtol=1e-5, atol=1e-5)
    # A fused layer that lost its lora_A is named, not dropped.
    del tensors["layers.0.ffn.w13.lora_A"]
    write_safetensors(tensors, tmp_path / KILN_WEIGHTS)
    with pytest.raises(DataError, match=r"LoRA layer 'layers\.0\.ffn\.w13' does not fit"):
        load_trainable(tiny_model(), tmp_path)
