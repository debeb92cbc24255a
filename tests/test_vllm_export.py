"""The HF export holds everything vLLM's Llama loader reads (vllm/model_executor/models/llama.py and
its weight loader), checked without vLLM itself (it does not install on this CPU machine):

- config.json: the architecture vLLM's registry looks up, and every field LlamaForCausalLM builds its
  layers from (hidden_size, intermediate_size, heads, kv heads, head_dim, layers, rms_norm_eps, the
  RoPE base, max_position_embeddings, vocab_size, hidden_act == "silu", no attention/MLP biases,
  tie_word_embeddings, the dtype, bos/eos ids, no rope scaling);
- weights: vLLM stacks q/k/v into qkv_proj and gate/up into gate_up_proj and looks every other name up
  in its parameters. A checkpoint name with no parameter is a KeyError there and a parameter no tensor
  fills stays uninitialised, so the test replays that mapping and wants an exact cover, with the shapes
  each parameter needs; lm_head is skipped when the embeddings are tied;
- *.safetensors files with the "pt" metadata (plus, if present, an index whose weight_map covers them);
- the tokenizer files vLLM hands to transformers' AutoTokenizer, the chat template vLLM's chat endpoint
  renders, and generation_config.json, whose eos ids vLLM stops on.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kiln.checkpoint import save_weights
from kiln.hf import export_checkpoint_to_hf
from kiln.model import ModelConfig, build_model

# (vLLM parameter, checkpoint shard name, shard) as in LlamaForCausalLM.load_weights.
STACKED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


@pytest.fixture(scope="module")
def tok(kiln_tokenizer):
    return kiln_tokenizer


def vllm_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters vLLM's LlamaForCausalLM creates from config.json, with their full (unsharded)
    shapes: fused qkv_proj and gate_up_proj, everything else one to one."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    params = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings", False):
        params["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        params.update(
            {
                p + "self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "mlp.gate_up_proj.weight": (2 * inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    return params


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    assert files, "vLLM loads *.safetensors; the export has none"
    index = folder / "model.safetensors.index.json"
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata().get("format") == "pt"  # transformers refuses files without it
            for name in f.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = f.get_tensor(name)
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        assert set(weight_map) == set(tensors)
        assert all((folder / file).is_file() for file in weight_map.values())
    return tensors


def load_like_vllm(config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Replay vLLM's name mapping; returns {parameter: {shard: shape}} and fails on a name vLLM has no
    parameter for."""
    params = vllm_parameters(config)
    tied = config.get("tie_word_embeddings", False)
    loaded: dict[str, dict] = {}
    for name, tensor in tensors.items():
        if "rotary_emb.inv_freq" in name or (tied and name.startswith("lm_head.")):
            continue
        for param, shard_name, shard in STACKED:  # noqa: B007 - shard is read after the break
            if shard_name in name:
                target = name.replace(shard_name, param)
                break
        else:
            target, shard = name, None
        assert target in params, f"vLLM's LlamaForCausalLM has no parameter for {name}"
        assert shard not in loaded.get(target, {}), f"{name} loaded twice"
        loaded.setdefault(target, {})[shard] = tuple(tensor.shape)
    assert set(loaded) == set(params), f"parameters left uninitialised: {sorted(set(params) - set(loaded))}"
    return loaded


@pytest.mark.parametrize(
    "overrides, dtype, chat",
    [
        ({}, torch.float32, False),
        ({"tie_embeddings": True, "n_kv_heads": 1}, torch.bfloat16, True),
        ({"n_kv_heads": 4, "rope_theta": 500000.0, "norm_eps": 1e-6}, torch.float32, False),
    ],
)
def test_export_has_what_vllms_llama_loader_reads(tmp_path, tok, overrides, dtype, chat):
    cfg = ModelConfig(
        **{**dict(vocab_size=tok.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256), **overrides}
    )
    state = {k: v.to(dtype) for k, v in build_model(cfg).state_dict().items()}
    ckpt = save_weights(tmp_path / "ckpt", cfg, state, {"step": 0})
    out = export_checkpoint_to_hf(ckpt, tok.path, tmp_path / "hf", chat=chat)

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    expected = {
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "num_hidden_layers": cfg.n_layers,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
    }
    assert {k: config.get(k) for k in expected} == expected
    # vLLM (through transformers 5) builds RoPE from rope_parameters; older ones from rope_theta and
    # rope_scaling, which must be absent or null for plain RoPE.
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg.rope_theta}
    assert config.get("rope_scaling") is None
    eot = tok.eot_id
    end = tok.token_id("<|end|>")
    assert config["bos_token_id"] == eot
    assert config["eos_token_id"] == ([end, eot] if chat else eot)

    tensors = read_weights(out)
    assert all(t.dtype == dtype for t in tensors.values())
    assert ("lm_head.weight" in tensors) != cfg.tie_embeddings
    params = vllm_parameters(config)
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for name, shards in load_like_vllm(config, tensors).items():
        if name.endswith("qkv_proj.weight"):
            assert shards == {"q": (q, cfg.dim), "k": (kv, cfg.dim), "v": (kv, cfg.dim)}
            assert q + 2 * kv == params[name][0]
        elif name.endswith("gate_up_proj.weight"):
            assert shards == {0: (cfg.ffn_hidden_size, cfg.dim), 1: (cfg.ffn_hidden_size, cfg.dim)}
        else:
            assert shards == {None: params[name]}

    # Tokenizer: what vLLM passes to AutoTokenizer, the chat template its chat endpoint renders, and
    # generation_config.json, whose eos ids (with config.json's) end generation.
    transformers = pytest.importorskip("transformers")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] and tok_config["eos_token"] == ("<|end|>" if chat else "<|endoftext|>")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] and generation["bos_token_id"] == eot
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x  # ok"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    rendered = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    from kiln.data.chat import render_prompt

    assert list(ids) == render_prompt(tok, messages)
    hf_config = transformers.AutoConfig.from_pretrained(out)
    assert type(hf_config).__name__ == "LlamaConfig"
    assert (getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)) == dtype
