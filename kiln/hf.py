"""Hugging Face checkpoints in and out: config.json + safetensors + tokenizer.

Export writes a folder that `transformers` (LlamaForCausalLM, or Qwen2ForCausalLM when the model has
q/k/v biases) and vLLM load as is. Import reads Llama, Mistral and Qwen2 folders. MoE models go out
and come in as Mixtral or Qwen2-MoE; their layers are mapped in kiln/hf_moe.py. A BERT ([model] arch =
"bert") goes out as BertForMaskedLM or BertForSequenceClassification (kiln/hf_bert.py), a T5 (arch =
"t5") as T5ForConditionalGeneration (kiln/hf_t5.py), and both import back.

Weight layout: Kiln's RoPE pairs dimension i with i + head_dim/2 ("rotate half"), the layout HF Llama
checkpoints are already stored in, so q/k rows are copied unchanged both ways. (Meta's original
consolidated.*.pth checkpoints pair adjacent dimensions and need a row permutation; Kiln does not
read that format.) The only reshaping is splitting Kiln's fused projection `wqkv` (its row layout is
described in kiln/model/transformer.py); SwiGLU's w1, w3, w2 are gate_proj, up_proj, down_proj.

The `kiln export` (hf, and single: a one-file Kiln checkpoint) and `kiln import` verbs are at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from kiln import hf_bert
from kiln.checkpoint import (
    loaded_line,
    read_manifest,
    read_safetensors,
    resolve_checkpoint,
    save_weights,
    write_safetensors,
)
from kiln.data.chat import ChatTokens, has_kiln_chat_tokens, hf_tokenizer_config_extra
from kiln.data.readers import read_json
from kiln.data.tokenizer import HF_TOKENIZER_FILES, MASK, Tokenizer, find_tokenizer
from kiln.errors import ConfigError, DataError
from kiln.files import copy_file_atomic, write_text_atomic
from kiln.hf_moe import (
    MOE_ARCHITECTURES,
    dense_layer_biases,
    moe_config_fields,
    moe_config_from_hf,
    moe_layer_from_hf,
    moe_layer_to_hf,
    moe_model_type,
)
from kiln.hf_t5 import hf_to_t5_state, t5_config_from_hf, t5_hf_config, t5_to_hf_state
from kiln.hf_tensors import TensorTaker
from kiln.model.config import ModelConfig, arch_of
from kiln.model.rope import rope_scaling_from_hf, rope_scaling_to_hf
from kiln.model.t5_config import T5Config
from kiln.model.transformer import fuse_qkv, split_qkv
from kiln.peft.load import plain_weights
from kiln.storage import is_remote, staged_output

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",  # Llama plus a per-head RMSNorm on q and k: Kiln's model.qk_norm
    **MOE_ARCHITECTURES,  # kiln/hf_moe.py
}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ---- name mapping -------------------------------------------------------------------------------


def kiln_to_hf_state(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # .contiguous() copies the row slices: safetensors refuses views into a larger tensor.
    out = {
        "model.embed_tokens.weight": state_dict["tok_embeddings.weight"],
        "model.norm.weight": state_dict["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state_dict["output.weight"]
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        suffixes = ("weight", "bias") if cfg.qkv_bias else ("weight",)
        for suffix in suffixes:
            q, k, v = split_qkv(state_dict[f"{src}attn.wqkv.{suffix}"], cfg.n_heads, cfg.kv_heads, cfg.head_dim)
            for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{dst}self_attn.{name}.{suffix}"] = t.contiguous()
        out.update(dense_layer_biases(cfg, i, out["model.norm.weight"]))
        if cfg.is_moe_layer(i):
            out.update(moe_layer_to_hf(cfg, i, state_dict))
        else:
            out[f"{dst}mlp.gate_proj.weight"] = state_dict[f"{src}ffn.w1.weight"]
            out[f"{dst}mlp.up_proj.weight"] = state_dict[f"{src}ffn.w3.weight"]
            out[f"{dst}mlp.down_proj.weight"] = state_dict[f"{src}ffn.w2.weight"]
        out.update(
            {
                f"{dst}self_attn.o_proj.weight": state_dict[f"{src}attn.wo.weight"],
                f"{dst}input_layernorm.weight": state_dict[f"{src}attn_norm.weight"],
                f"{dst}post_attention_layernorm.weight": state_dict[f"{src}ffn_norm.weight"],
            }
        )
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                out[f"{dst}self_attn.{name}.weight"] = state_dict[f"{src}attn.{name}.weight"]
    return {name: t.detach().contiguous() for name, t in out.items()}


def hf_to_kiln_state(cfg: ModelConfig, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    take = TensorTaker(tensors, where)
    out = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["output.weight"] = take("lm_head.weight")
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        suffixes = ("weight", "bias") if cfg.qkv_bias else ("weight",)
        for suffix in suffixes:
            out[f"{dst}attn.wqkv.{suffix}"] = fuse_qkv(
                *(take(f"{src}self_attn.{p}.{suffix}") for p in ("q_proj", "k_proj", "v_proj")), cfg.kv_heads
            )
        out[f"{dst}attn.wo.weight"] = take(f"{src}self_attn.o_proj.weight")
        if cfg.is_moe_layer(i):
            out.update(moe_layer_from_hf(cfg, i, take, take.__contains__, where))
        else:
            out[f"{dst}ffn.w1.weight"] = take(f"{src}mlp.gate_proj.weight")
            out[f"{dst}ffn.w3.weight"] = take(f"{src}mlp.up_proj.weight")
            out[f"{dst}ffn.w2.weight"] = take(f"{src}mlp.down_proj.weight")
        out[f"{dst}attn_norm.weight"] = take(f"{src}input_layernorm.weight")
        out[f"{dst}ffn_norm.weight"] = take(f"{src}post_attention_layernorm.weight")
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                out[f"{dst}attn.{name}.weight"] = take(f"{src}self_attn.{name}.weight")
    # A tied checkpoint may still store lm_head; old ones store the RoPE frequencies. Anything else
    # means a layer Kiln would silently drop (o_proj or MLP biases, extra norms), so refuse it.
    tied_head = {"lm_head.weight"} if cfg.tie_embeddings else set()
    take.refuse_leftovers("Kiln's Transformer", lambda n: n in tied_head or n.endswith("rotary_emb.inv_freq"))
    return out


# ---- export -------------------------------------------------------------------------------------


def _check_exportable(cfg: ModelConfig) -> None:
    moe_model_type(cfg)  # refuses the MoE variants no HF class computes
    if cfg.qk_norm and cfg.qkv_bias:
        # Qwen3 (the HF class with q/k norms) has one attention_bias switch, which also adds an o_proj bias.
        raise ConfigError("qk_norm", "HF export of q/k norms is Qwen3's, which has no q/k/v-only biases (qkv_bias)")
    if cfg.qk_norm and moe_model_type(cfg):
        raise ConfigError("qk_norm", "HF export of q/k norms covers dense models (Qwen3) only, not MoE")
    needs = {"pos": "rope", "norm": "rmsnorm", "ffn": "swiglu"}
    for key, value in needs.items():
        if getattr(cfg, key) != value:
            raise ConfigError(
                key, f"HF export supports Llama-style models only ({key}={value!r}), got {getattr(cfg, key)!r}"
            )


def _kiln_tokenizer_config(tok: Tokenizer, model_cfg: ModelConfig, chat: bool) -> tuple[dict, dict]:
    """(tokenizer_config.json, special ids for config.json) for a Kiln-trained tokenizer, which has no
    config of its own: its roles (eos = bos = <|endoftext|>, <|pad|>) and, with Kiln's chat tokens,
    the chat template."""
    eos = tok.eot_id
    special_ids = {"bos_token_id": tok.prefix_id, "eos_token_id": eos}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{key: tok.special[key] for key in ("bos_token", "eos_token", "pad_token") if tok.special[key]},
        "model_max_length": model_cfg.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    if tok.hf.token_to_id(MASK) is not None:  # what a masked-LM pipeline (fill-mask) predicts at
        tok_config["mask_token"] = MASK
    if has_kiln_chat_tokens(tok):
        # The chat template travels with every export, so apply_chat_template gives Kiln's ids; a
        # chat model (chat=True) also stops generating at the end of its turn.
        tok_config.update(hf_tokenizer_config_extra(chat=chat))
        if chat:
            special_ids = {
                "bos_token_id": tok.prefix_id,
                "eos_token_id": list(ChatTokens(tok).stop),
                "pad_token_id": tok.pad_id,
            }
    return tok_config, special_ids


def _write_tokenizer(tokenizer_path, model_cfg: ModelConfig, out: Path, chat: bool) -> dict:
    """Copy the tokenizer into out; returns the special token ids config.json carries. An imported
    tokenizer's own config files (tokenizer_config.json, special_tokens_map.json, chat_template.jinja)
    go back as they came, so AutoTokenizer loads it as before the import; a Kiln tokenizer gets Kiln's."""
    tok = Tokenizer.load(tokenizer_path)
    if tok.vocab_size > model_cfg.vocab_size:
        raise ConfigError(
            "vocab_size", f"model has {model_cfg.vocab_size} embeddings but {tok.path} has {tok.vocab_size} tokens"
        )
    copy_file_atomic(tok.path, out / "tokenizer.json")
    own = [tok.path.parent / name for name in HF_TOKENIZER_FILES if (tok.path.parent / name).is_file()]
    if not own:
        tok_config, special_ids = _kiln_tokenizer_config(tok, model_cfg, chat)
        write_text_atomic(out / "tokenizer_config.json", json.dumps(tok_config, indent=2) + "\n")
        return special_ids
    for path in own:
        copy_file_atomic(path, out / path.name)
    special_ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eot_id, "pad_token_id": tok.pad_id}
    return {key: value for key, value in special_ids.items() if value is not None}


def export_hf(
    model_cfg: ModelConfig, state_dict: dict[str, torch.Tensor], tokenizer_path, out_dir, chat: bool = False
) -> Path | str:
    """Write a transformers-loadable folder. tokenizer_path (tokenizer.json or a folder holding it)
    may be None to export weights only. Tensors keep the dtype they have in state_dict. An fsspec
    URL out_dir is written locally and uploaded with config.json, what loaders look for, last."""
    with staged_output(out_dir, "config.json") as out:
        written = _export_hf_local(model_cfg, state_dict, tokenizer_path, out, chat)
    return out_dir if is_remote(out_dir) else written


def _export_hf_local(model_cfg: ModelConfig, state_dict: dict, tokenizer_path, out: Path, chat: bool) -> Path:
    if arch_of(model_cfg) == "bert":
        out.mkdir(parents=True, exist_ok=True)
        return _export_bert(model_cfg, state_dict, tokenizer_path, out)
    if isinstance(model_cfg, T5Config):
        tensors = t5_to_hf_state(model_cfg, state_dict)
        out.mkdir(parents=True, exist_ok=True)
        if tokenizer_path is not None:
            _write_tokenizer(tokenizer_path, model_cfg, out, chat)
        config = t5_hf_config(model_cfg, _dtype_name(tensors["shared.weight"].dtype))
        special_ids = {key: config[key] for key in ("pad_token_id", "eos_token_id", "decoder_start_token_id")}
        return _write_folder(out, tensors, config, special_ids)
    _check_exportable(model_cfg)
    out.mkdir(parents=True, exist_ok=True)
    tensors = kiln_to_hf_state(model_cfg, state_dict)
    dtype = tensors["model.embed_tokens.weight"].dtype
    special_ids = {} if tokenizer_path is None else _write_tokenizer(tokenizer_path, model_cfg, out, chat)

    # Llama's attention_bias would add an o_proj bias, hence Qwen2 for q/k/v biases; Qwen3 for q/k norms.
    model_type = moe_model_type(model_cfg) or ("qwen2" if model_cfg.qkv_bias else "llama")
    model_type = "qwen3" if model_cfg.qk_norm else model_type
    config = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": model_cfg.vocab_size,
        "hidden_size": model_cfg.dim,
        "intermediate_size": model_cfg.ffn_hidden_size,
        "num_hidden_layers": model_cfg.n_layers,
        "num_attention_heads": model_cfg.n_heads,
        "num_key_value_heads": model_cfg.kv_heads,
        "head_dim": model_cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model_cfg.max_seq_len,
        "rms_norm_eps": model_cfg.norm_eps,
        # rope_theta at top level is what transformers 4.x and vLLM read; 5.x reads rope_parameters.
        "rope_theta": model_cfg.rope_theta,
        **rope_scaling_to_hf(model_cfg),  # rope_parameters (5.x) and, when scaled, rope_scaling (4.x)
        "tie_word_embeddings": model_cfg.tie_embeddings,
        "initializer_range": model_cfg.init_std,
        "torch_dtype": _dtype_name(dtype),
        "use_cache": True,
        **special_ids,
    }
    if model_type in ("llama", "qwen3"):
        config.update(attention_bias=False, mlp_bias=False)
    if model_type not in ("llama", "mixtral"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=model_cfg.n_layers)
    config.update(moe_config_fields(model_cfg))
    return _write_folder(out, tensors, config, special_ids)


def _dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _write_folder(out: Path, tensors: dict, config: dict, special_ids: dict) -> Path:
    # Weights first, config.json last: a folder transformers can open has all of its files.
    write_safetensors(tensors, out / "model.safetensors")
    generation = {"_from_model_config": True, **special_ids}
    write_text_atomic(out / "generation_config.json", json.dumps(generation, indent=2) + "\n")
    write_text_atomic(out / "config.json", json.dumps(config, indent=2) + "\n")
    return out


def _export_bert(cfg, state_dict: dict, tokenizer_path, out: Path) -> Path:
    """A Kiln BERT as a BertForMaskedLM (or BertForSequenceClassification) folder."""
    tensors = hf_bert.kiln_to_hf_state(cfg, state_dict)
    special_ids = {} if tokenizer_path is None else _write_tokenizer(tokenizer_path, cfg, out, chat=False)
    pad = Tokenizer.load(tokenizer_path).pad_id if tokenizer_path is not None else None
    config = hf_bert.hf_config(cfg, pad)
    dtype = tensors["bert.embeddings.word_embeddings.weight"].dtype
    config["torch_dtype"] = _dtype_name(dtype)
    config.update({k: v for k, v in special_ids.items() if k != "pad_token_id"})
    return _write_folder(out, tensors, config, special_ids)


# ---- import -------------------------------------------------------------------------------------


def config_from_hf(hf: dict, where: str) -> ModelConfig:
    """Map a Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen2-MoE config.json to a ModelConfig, refusing what Kiln cannot
    represent."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise DataError(
            f"{where}: model_type {model_type!r} is not supported; Kiln imports {', '.join(ARCHITECTURES)}, bert, t5"
        )

    def refuse(key: str, why: str):
        raise DataError(f"{where}: {key}={hf.get(key)!r}: {why}")

    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only SwiGLU (silu) MLPs are supported")
    if hf.get("attention_bias") and model_type != "qwen2":
        refuse("attention_bias", "Kiln has biases on q/k/v only, not on the output projection")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", "MLP biases are not supported")
    # transformers 5 lets rope_scaling (the 4.x key) win when a config has both.
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    dim, n_heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // n_heads):
        refuse("head_dim", f"Kiln derives head_dim = hidden_size / num_attention_heads = {dim // n_heads}")
    rope_scaling, max_seq_len = rope_scaling_from_hf(rope, hf.get("max_position_embeddings", 2048))
    # Sliding-window attention equals full causal attention for sequences no longer than the window,
    # so the window caps the context instead of being an unsupported feature.
    window = hf.get("sliding_window")
    if window and (model_type in ("mistral", "mixtral") or hf.get("use_sliding_window")):
        max_seq_len = min(max_seq_len, window)
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        ffn_hidden=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling,
        max_seq_len=max_seq_len,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        init_std=hf.get("initializer_range", 0.02),
    )
    cfg = replace(cfg, **moe_config_from_hf(hf, where))
    cfg.validate()
    return cfg


# Weight files that are Python pickles: loading one from an unknown source can run any code it
# carries, and even torch.load(weights_only=True) has had bypasses (CVE-2025-32434). Kiln reads
# safetensors only and says how to convert.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
CONVERT_HINT = (
    "Kiln never unpickles weights (a pickle can run code when loaded): convert them to safetensors "
    "on a machine where you trust the file (e.g. transformers' save_pretrained(OUT, "
    "safe_serialization=True)), or download the model's .safetensors files instead"
)


def _refuse_pickle(path: Path, where) -> None:
    if path.name.lower().endswith(PICKLE_SUFFIXES):
        raise DataError(f"{where}: {path.name} is a pickled weight file, which is not read. {CONVERT_HINT}")


def _load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index).get("weight_map", {}).values()))
        if not files:
            raise DataError(f"{index}: weight_map is empty")
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        pickled = sorted(p.name for p in folder.iterdir() if p.name.lower().endswith(PICKLE_SUFFIXES))
        raise DataError(
            f"{folder}: no model.safetensors or model.safetensors.index.json"
            + (f"; found only pickled weights ({', '.join(pickled[:3])}). {CONVERT_HINT}" if pickled else "")
        )
    tensors = {}
    for name in files:
        path = folder / str(name)
        # The index is data from the download: a shard must be a safetensors file in this folder.
        if Path(str(name)).name != name or name in (".", ".."):
            raise DataError(f"{index}: shard {name!r} in weight_map is not a file name inside {folder}")
        _refuse_pickle(path, index)
        if not path.is_file():
            raise DataError(f"{index}: shard {name} listed in weight_map is missing")
        tensors.update(read_safetensors(path))
    return tensors


# Encoder and encoder-decoder families: (config.json -> config, HF tensors -> Kiln state_dict).
FAMILY_IMPORTERS = {
    "bert": (hf_bert.config_from_hf, hf_bert.hf_to_kiln_state),
    "t5": (t5_config_from_hf, hf_to_t5_state),
}


def import_hf(folder) -> tuple[ModelConfig | T5Config, dict[str, torch.Tensor]]:
    """(model config, Kiln state_dict) of a local Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, BERT or T5
    folder (a BertConfig / T5Config for those), in the checkpoint's dtype."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder")
    config_path = folder / "config.json"
    hf = read_json(config_path)
    family = hf.get("model_type") if isinstance(hf, dict) else None
    read_config, to_kiln = FAMILY_IMPORTERS.get(family, (config_from_hf, hf_to_kiln_state))
    try:
        cfg = read_config(hf, str(config_path))
    except KeyError as err:
        raise DataError(f"{config_path}: missing key {err.args[0]!r}") from None
    except ConfigError as err:
        raise DataError(f"{config_path}: {err}") from None
    return cfg, to_kiln(cfg, _load_safetensors(folder), str(folder))


# ---- checkpoint glue (the `kiln export hf` / `kiln import hf` verbs) ----------------------------


def import_hf_to_checkpoint(folder, out_dir) -> Path:
    """Convert an HF folder into a Kiln weights checkpoint at out_dir; its tokenizer.json is copied
    alongside when present, with the config files that name its special tokens and chat template
    (tokenizer_config.json, special_tokens_map.json, chat_template.jinja), so `kiln generate`,
    `kiln serve` and `kiln eval` use the result directly and `kiln export hf` writes them back."""
    cfg, state = import_hf(folder)
    out = save_weights(out_dir, cfg, state, manifest_extra={"step": 0, "source": {"hf": str(Path(folder).resolve())}})
    tokenizer = Path(folder) / "tokenizer.json"
    if tokenizer.is_file():
        Tokenizer.load(tokenizer)  # its config names tokens it has (or the import stops here, saying which)
        for name in ("tokenizer.json", *HF_TOKENIZER_FILES):
            if (Path(folder) / name).is_file():
                shutil.copyfile(Path(folder) / name, Path(out) / name)
    return Path(out)


def export_checkpoint_to_hf(
    ckpt_path, tokenizer_path, out_dir, chat: bool | None = None, dtype: str | None = None
) -> Path:
    """Export a Kiln checkpoint (folder, checkpoints root or stage folder) to an HF folder. chat=None:
    a chat model when the checkpoint comes from a post-training stage (its recipe ran sft/dpo/grpo).
    dtype (float32, bfloat16, float16) casts the floating-point tensors; None keeps the checkpoint's.
    A LoRA/QLoRA training checkpoint exports with its LoRA merged; one with bottleneck adapters is
    refused (a Llama model has no place for them)."""
    cfg, state, manifest = plain_weights(ckpt_path, adapters=False)
    if dtype is not None:
        cast = getattr(torch, dtype)
        state = {name: t.to(cast) if t.is_floating_point() else t for name, t in state.items()}
    if chat is None:
        chat = any(part in ("sft", "dpo", "grpo") for part in Path(ckpt_path).resolve().parts)
    return export_hf(cfg, state, tokenizer_path, out_dir, chat=chat)


def export_stage_checkpoint(checkpoint: Path, tokenizer_path: Path, out: Path, chat: bool, dtype: str | None) -> dict:
    """The export stage's work (kiln.pipeline): say which checkpoint is loaded, export it, and return
    the figures its stats.json keeps."""
    manifest = read_manifest(checkpoint)
    print(loaded_line(checkpoint, manifest))
    export_checkpoint_to_hf(checkpoint, tokenizer_path, out, chat=chat, dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    return {
        "checkpoint": str(checkpoint),
        "step": manifest.get("step"),
        "architecture": config["architectures"][0],
        "dtype": config.get("torch_dtype"),
        "chat": chat,
        "folder": str(out),
    }


# ---- the `kiln export` and `kiln import` verbs --------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="export a checkpoint to another format")
    fmt = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    e = fmt.add_parser(
        "hf",
        help="Hugging Face folder (Llama, Qwen2, Mixtral, Qwen2-MoE, BERT or T5) that transformers loads",
    )
    e.add_argument("checkpoint", help="Kiln checkpoint: a checkpoint folder, or a stage folder (runs/NAME/pretrain)")
    e.add_argument("out", help="folder to write the Hugging Face model into (config.json, model.safetensors)")
    e.add_argument("--tokenizer", help="tokenizer.json (default: found next to the checkpoint)")

    e = fmt.add_parser("single", help="one-file checkpoint (model.safetensors + manifest), e.g. from a sharded one")
    e.add_argument("checkpoint", help="Kiln checkpoint folder, sharded or not")
    e.add_argument("out", help="folder to write the one-file checkpoint into")

    p = subparsers.add_parser("import", help="import a checkpoint from another format")
    fmt = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    i = fmt.add_parser(
        "hf", help="local Llama / Mistral / Qwen2 / Mixtral / Qwen2-MoE / BERT / T5 folder into a Kiln checkpoint"
    )
    i.add_argument("folder", help="local Hugging Face model folder (config.json and *.safetensors)")
    i.add_argument("out", help="folder to write the Kiln checkpoint into")


def run(args: argparse.Namespace) -> int:
    if args.verb == "export":
        folder = resolve_checkpoint(args.checkpoint)
        print(loaded_line(folder, read_manifest(folder)))
    if args.verb == "export" and args.format == "single":
        cfg, state, manifest = plain_weights(args.checkpoint)
        save_weights(args.out, cfg, state, {"step": manifest.get("step"), "converted_from": str(args.checkpoint)})
        print(f"wrote {args.out}/model.safetensors ({len(state)} tensors, step {manifest.get('step')})")
        return 0
    if args.verb == "export":
        tokenizer = Path(args.tokenizer) if args.tokenizer else find_tokenizer(args.checkpoint)
        export_checkpoint_to_hf(args.checkpoint, tokenizer, args.out)
        print(f"exported {args.checkpoint} -> {args.out}")
        print(f"next: AutoModelForCausalLM.from_pretrained({str(args.out)!r}) in transformers, or kiln import hf")
        return 0
    import_hf_to_checkpoint(args.folder, args.out)
    print(f"imported {args.folder} -> {args.out}")
    return 0
