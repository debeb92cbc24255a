import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from kiln_testing.models import randomise  # noqa: E402
from kiln_testing.tokenizer import train_byte_bpe  # noqa: E402

from kiln.errors import ConfigError, DataError  # noqa: E402
from kiln.hf import export_checkpoint_to_hf, export_hf, import_hf, import_hf_to_checkpoint  # noqa: E402
from kiln.model import ModelConfig, build_model  # noqa: E402

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Kiln turns raw text into a model; 12345 tokens, ümlauts and emoji 🙂 too.",
] * 5


def make_tokenizer(path):
    """A bare byte-level BPE with the model's vocabulary of 320, <|endoftext|> and <|pad|> first."""
    return train_byte_bpe(path, TEXT, vocab_size=320, special_tokens=("<|endoftext|>", "<|pad|>"))


def kiln_model(**overrides):
    cfg = ModelConfig(
        **{**dict(vocab_size=320, dim=64, n_layers=2, n_heads=4, max_seq_len=64, rope_theta=500.0), **overrides}
    )
    return randomise(build_model(cfg)).eval()


TOKENS = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_kv_heads": 2},
        {"n_kv_heads": 1, "tie_embeddings": True},
        {"qkv_bias": True, "n_kv_heads": 2},
        {"qk_norm": True, "n_kv_heads": 2},
    ],
)
def test_export_matches_transformers_logits(tmp_path, overrides):
    model = kiln_model(**overrides)
    export_hf(model.cfg, model.state_dict(), None, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    expected_class = "Qwen2ForCausalLM" if model.cfg.qkv_bias else "LlamaForCausalLM"
    expected_class = "Qwen3ForCausalLM" if model.cfg.qk_norm else expected_class
    assert type(hf).__name__ == expected_class
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, model(TOKENS), rtol=1e-4, atol=1e-4)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] == model.cfg.tie_embeddings
    assert config["num_key_value_heads"] == model.cfg.kv_heads


def hf_model(kind, **extra):
    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=1000.0,
    )
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    return randomise(model_cls(config_cls(**{**common, **extra}))).eval()


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
        ("mistral", {"sliding_window": None}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {"head_dim": 16}),  # Qwen3Config's head_dim defaults to 128, not hidden/heads
    ],
)
def test_import_matches_transformers_logits(tmp_path, kind, extra):
    hf = hf_model(kind, **extra)
    hf.save_pretrained(tmp_path)
    cfg, state = import_hf(tmp_path)
    assert cfg.qkv_bias == (kind == "qwen2")
    assert cfg.qk_norm == (kind == "qwen3")
    model = build_model(cfg)
    model.load_state_dict(state)  # strict: every Kiln tensor is present and nothing extra
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, rtol=1e-4, atol=1e-4)


def test_import_sharded_and_sliding_window_caps_context(tmp_path):
    hf = hf_model("mistral", sliding_window=32)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg, state = import_hf(tmp_path)
    assert cfg.max_seq_len == 32  # full attention equals the sliding window up to its length
    model = build_model(cfg)
    model.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS[:, :32]), hf(TOKENS[:, :32]).logits, rtol=1e-4, atol=1e-4)


def test_exported_tokenizer_loads_with_identical_ids(tmp_path):
    tok = make_tokenizer(tmp_path / "tokenizer.json")
    model = kiln_model()
    out = export_hf(model.cfg, model.state_dict(), tmp_path / "tokenizer.json", tmp_path / "hf")
    eot = tok.token_to_id("<|endoftext|>")
    for loaded in (
        transformers.PreTrainedTokenizerFast.from_pretrained(out),
        transformers.AutoTokenizer.from_pretrained(out),
    ):
        assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id == eot
        for text in TEXT[:3] + ["<|endoftext|>next doc"]:
            assert loaded(text)["input_ids"] == tok.encode(text).ids
            assert loaded.decode(tok.encode(text).ids) == text
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == eot
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == eot


def test_checkpoint_roundtrip_through_hf(tmp_path):
    make_tokenizer(tmp_path / "tokenizer.json")
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_bytes((tmp_path / "tokenizer.json").read_bytes())
    ckpt = import_hf_to_checkpoint(tmp_path / "hf", tmp_path / "ckpt")
    assert (ckpt / "tokenizer.json").is_file()
    out = export_checkpoint_to_hf(ckpt, tmp_path / "tokenizer.json", tmp_path / "hf2")
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS).logits, hf(TOKENS).logits, rtol=1e-5, atol=1e-5)


def test_export_refuses_what_llama_cannot_represent(tmp_path):
    for key, value in [("pos", "learned"), ("norm", "layernorm"), ("ffn", "gelu")]:
        model = kiln_model(**{key: value})
        with pytest.raises(ConfigError, match=key):
            export_hf(model.cfg, model.state_dict(), None, tmp_path)
    model = kiln_model(qk_norm=True, qkv_bias=True)  # Qwen3's attention_bias would add an o_proj bias
    with pytest.raises(ConfigError, match="qk_norm"):
        export_hf(model.cfg, model.state_dict(), None, tmp_path)


def test_import_errors_name_the_problem(tmp_path):
    with pytest.raises(DataError, match="config.json: not found"):
        import_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(DataError, match="model_type 'gpt2' is not supported"):
        import_hf(tmp_path)
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}})
    )
    with pytest.raises(DataError, match="rope_parameters"):
        import_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(DataError, match="no model.safetensors"):
        import_hf(tmp_path)
