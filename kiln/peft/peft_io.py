"""Saving and loading only the small trainable weights, and plain state dicts for export.

Two formats:

* Hugging Face PEFT (`adapter_config.json` + `adapter_model.safetensors`), LoRA only, under the module
  names of the exported LlamaForCausalLM (kiln.hf.export_hf), so `peft.PeftModel.from_pretrained(hf_model,
  dir)` loads a Kiln adapter, and vLLM or transformers serve it. Keys are
  `base_model.model.<hf module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r].
  Kiln's fused layers map exactly: the LoRA of `attn.wqkv` becomes LoRAs on q_proj, k_proj and v_proj that
  all share its A, with B split by rows by kiln.model.transformer.split_qkv (each of rank r, same alpha,
  so s B_q A is exactly the q rows of s B A). `attn.wo`, `ffn.w1`, `ffn.w3`, `ffn.w2`, `output` are
  o_proj, gate_proj, up_proj, down_proj, lm_head. Loading the other way fuses q/k/v back. When the parts share one A and one scale (any
  adapter Kiln wrote) the result is the original rank-r LoRA. Otherwise (an adapter trained with `peft`,
  or one that targets only q_proj and v_proj) the parts are stacked into one LoRA of rank
  r_q + r_k + r_v: A = [A_q; A_k; A_v] and each part's B occupies its own columns, zero elsewhere, which
  is the same weight update exactly; it saves back to PEFT exactly too (rank_pattern records the rank).
* Kiln's own (`kiln_peft.json` + `kiln_peft.safetensors`) for any method, including bottleneck adapters
  (which PEFT's format has no type for) and models transformers cannot represent (MoE, GELU FFNs):
  the Kiln parameter names of LoRA and adapter weights, with the recipe's PeftConfig to rebuild the
  structure (quantising the base again for qlora, which is deterministic).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn

from kiln.checkpoint import read_safetensors, write_safetensors
from kiln.data.readers import read_json
from kiln.errors import DataError
from kiln.files import write_text_atomic
from kiln.model.transformer import fuse_qkv, split_qkv
from kiln.model.weights import split_gate_up
from kiln.peft.adapter import (
    AdapterConfig,
    adapter_modules,
    adapter_state_dict,
    apply_adapters,
    load_adapter_state_dict,
)
from kiln.peft.config import PeftConfig, lora_scaling
from kiln.peft.lora import LoRALinear, lora_modules, lora_state_dict, set_lora
from kiln.peft.nf4 import NF4Linear, quantize_base

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
KILN_CONFIG, KILN_WEIGHTS = "kiln_peft.json", "kiln_peft.safetensors"
PREFIX = "base_model.model."
# 2: SwiGLU's gate and up are separate layers (ffn.w1, ffn.w3; weights layout 3). Version 1 files,
# written for the fused ffn.w13 with gate and up rows interleaved, are converted when they load.
KILN_PEFT_VERSION = 2
QKV = ("q_proj", "k_proj", "v_proj")
_KILN_LAYER = re.compile(r"layers\.(\d+)\.(attn\.wqkv|attn\.wo|ffn\.w1|ffn\.w3|ffn\.w2)$")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj$")
_SIMPLE = {"attn.wo": "self_attn.o_proj", "ffn.w1": "mlp.gate_proj", "ffn.w3": "mlp.up_proj", "ffn.w2": "mlp.down_proj"}
# The layers whose base weights peft's save_pretrained copies into the adapter (save_embedding_layers).
_EMBEDDING_LAYERS = {"lm_head": "output", "model.embed_tokens": "tok_embeddings"}


# ---- plain state dicts --------------------------------------------------------------------------


def _plain_state(model: nn.Module, merge: bool, keep_adapters: bool = False) -> dict[str, torch.Tensor]:
    state = {k: v.detach() for k, v in model.state_dict().items()}
    loras = lora_modules(model)
    layers = {name: (m.base, m) for name, m in loras.items()}
    layers.update(
        {
            name: (m, None)
            for name, m in model.named_modules()
            if isinstance(m, NF4Linear) and name.removesuffix(".base") not in loras
        }
    )
    for name, (base, lora) in layers.items():
        for key in [k for k in state if k.startswith(name + ".")]:
            del state[key]
        if isinstance(base, NF4Linear):
            weight, dtype = base.dequantize(torch.float32), base.weight_dtype
        else:
            weight, dtype = base.weight.detach().float(), base.weight.dtype
        if lora is not None and merge != lora.merged:
            weight = weight + lora.delta_weight() if merge else weight - lora.delta_weight()
        state[f"{name}.weight"] = weight.to(dtype)
        if base.bias is not None:
            state[f"{name}.bias"] = base.bias.detach()
    for name in () if keep_adapters else adapter_modules(model):
        for key in [k for k in state if k.startswith(name + ".")]:
            del state[key]
    return state


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain Kiln state dict (the keys of an unwrapped Transformer) with every LoRA update added to
    its weight in float32 and NF4 weights dequantised: what kiln.hf.export_hf or a weights checkpoint
    takes. The model is not modified. Refused for bottleneck adapters, which cannot be folded in."""
    if adapter_modules(model):
        raise ValueError(
            "bottleneck adapters cannot be merged into the base weights; save them with "
            "save_trainable and export the base with base_state_dict"
        )
    return _plain_state(model, merge=True)


def folded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """merged_state_dict with the bottleneck adapters' weights kept under their own names: LoRA
    folded into plain weights, NF4 dequantised, what a Transformer with the same adapters loads."""
    return _plain_state(model, merge=True, keep_adapters=True)


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain Kiln state dict of the frozen base: LoRA updates and adapters left out, NF4 weights
    dequantised (the weights the QLoRA forward computes with, so a PEFT adapter on the exported base
    reproduces the QLoRA model)."""
    return _plain_state(model, merge=False)


# ---- Kiln format --------------------------------------------------------------------------------


def peft_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every PEFT weight (LoRA matrices and adapters) under its Kiln parameter name."""
    return {**lora_state_dict(model), **adapter_state_dict(model)}


def save_trainable(model: nn.Module, cfg: PeftConfig, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: t.contiguous() for k, t in peft_state_dict(model).items()}
    if not tensors:
        raise ValueError("the model has no LoRA layers or adapters to save")
    meta = {
        "format": "kiln-peft",
        "version": KILN_PEFT_VERSION,
        "peft": asdict(cfg),
        "lora": {name: {"r": m.r, "scaling": m.scaling} for name, m in lora_modules(model).items()},
    }
    write_safetensors(tensors, out / KILN_WEIGHTS)
    write_text_atomic(out / KILN_CONFIG, json.dumps(meta, indent=2) + "\n")
    return out


def _freeze_all_but_peft(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)
    for m in [*lora_modules(model).values(), *adapter_modules(model).values()]:
        for name, p in m.named_parameters():
            if not name.startswith("base."):
                p.requires_grad_(True)


def _split_fused_gate_up(meta: dict, tensors: dict) -> None:
    """A version-1 file's LoRA on a fused w13 (B's rows gate_0, up_0, gate_1, ...) as the two LoRAs
    on w1 and w3 that share its A and scale: B's even rows and odd rows, the same update exactly."""
    targets = []
    for target in meta["peft"].get("targets", []):
        stem, _, last = target.rpartition(".")
        fused = last == "w13"
        targets += [f"{stem}.{p}" if stem else p for p in ("w1", "w3")] if fused else [target]
    meta["peft"]["targets"] = targets
    # A layer missing lora_A or lora_B stays as it is, for load_trainable to name as not fitting.
    complete = [
        n for n in meta.get("lora", {}) if n.endswith(".w13") and {f"{n}.lora_A", f"{n}.lora_B"} <= set(tensors)
    ]
    for name in complete:
        info, stem = meta["lora"].pop(name), name.removesuffix(".w13")
        A = tensors.pop(f"{name}.lora_A")
        for proj, rows in zip(("w1", "w3"), split_gate_up(tensors.pop(f"{name}.lora_B"), layout=2)):
            meta["lora"][f"{stem}.{proj}"] = info
            tensors[f"{stem}.{proj}.lora_A"], tensors[f"{stem}.{proj}.lora_B"] = A.clone(), rows.contiguous()


def load_trainable(model: nn.Module, in_dir) -> PeftConfig:
    """Rebuild the PEFT structure saved by save_trainable on a plain (base-weights) Kiln model and load
    the weights; returns the saved PeftConfig."""
    folder = Path(in_dir)
    meta = read_json(folder / KILN_CONFIG)
    if meta.get("format") != "kiln-peft":
        raise DataError(f"{folder / KILN_CONFIG}: not a Kiln PEFT file (format {meta.get('format')!r})")
    tensors = read_safetensors(folder / KILN_WEIGHTS)
    if meta.get("version", 1) < 2:
        _split_fused_gate_up(meta, tensors)
    cfg = PeftConfig(**meta["peft"])
    cfg.validate()
    if cfg.method == "qlora" and not any(isinstance(m, NF4Linear) for m in model.modules()):
        quantize_base(model, cfg.nf4_block_size, cfg.double_quant)
    for name, info in meta.get("lora", {}).items():
        try:
            set_lora(
                model, name, tensors.pop(f"{name}.lora_A"), tensors.pop(f"{name}.lora_B"), info["scaling"], cfg.dropout
            )
        except (KeyError, AttributeError) as err:
            raise DataError(f"{folder}: LoRA layer {name!r} does not fit the model ({err})") from None
    if cfg.method == "adapter":
        if not adapter_modules(model):
            apply_adapters(model, AdapterConfig(hidden=cfg.adapter_hidden))
        load_adapter_state_dict(model, tensors)
    elif tensors:
        raise DataError(f"{folder / KILN_WEIGHTS}: tensors with no place in the model: {sorted(tensors)[:4]}")
    _freeze_all_but_peft(model)
    return cfg


# ---- Hugging Face PEFT format -------------------------------------------------------------------


def _hf_parts(name: str, lora: LoRALinear, cfg) -> list[tuple[str, torch.Tensor]]:
    """[(HF module name, B rows for it)] for one Kiln LoRA layer; all share the layer's A."""
    B = lora.lora_B.detach()
    if name == "output":
        return [("lm_head", B)]
    match = _KILN_LAYER.fullmatch(name)
    if match is None:
        raise ValueError(
            f"LoRA layer {name!r} has no counterpart in a Hugging Face Llama model; "
            f"save it with save_trainable (Kiln format) instead"
        )
    layer, kind = match.groups()
    prefix = f"model.layers.{layer}."
    if kind == "attn.wqkv":
        q, k, v = split_qkv(B, cfg.n_heads, cfg.kv_heads, cfg.head_dim)
        return [(f"{prefix}self_attn.{p}", b) for p, b in zip(QKV, (q, k, v))]
    return [(prefix + _SIMPLE[kind], B)]


def save_peft_adapter(
    model: nn.Module, model_cfg, out_dir, peft_cfg: PeftConfig | None = None, base_model_name_or_path: str | None = None
) -> Path:
    """Write the model's LoRA layers in Hugging Face PEFT format for the model kiln.hf.export_hf writes.

    r, lora_alpha, use_rslora and lora_dropout come from peft_cfg when given; otherwise r is the most
    common rank, alpha = scale * r and rsLoRA off (the same update either way). A layer whose rank or
    scale differs from the config's is written with a rank_pattern entry and its scale folded into B."""
    cfg = model_cfg if model_cfg is not None else model.cfg
    loras = lora_modules(model)
    if not loras:
        raise ValueError("the model has no LoRA layers to save")
    if adapter_modules(model):
        raise ValueError("the PEFT format cannot hold Kiln's bottleneck adapters; use save_trainable")
    if any(m.merged for m in loras.values()):
        raise ValueError("LoRA layers are merged into the base; unmerge_lora(model) before saving the adapter")
    if peft_cfg is not None:
        r, alpha, rslora, dropout = peft_cfg.r, peft_cfg.alpha, peft_cfg.rslora, peft_cfg.dropout
    else:
        r = Counter(m.r for m in loras.values()).most_common(1)[0][0]
        scale = Counter(m.scaling for m in loras.values() if m.r == r).most_common(1)[0][0]
        alpha, rslora = scale * r, False
        dropout = next((m.dropout.p for m in loras.values() if isinstance(m.dropout, nn.Dropout)), 0.0)
    tensors, targets, rank_pattern = {}, set(), {}
    for name, lora in loras.items():
        # PEFT derives a layer's scale from its rank; fold any difference into B so the update is unchanged.
        fold = lora.scaling / lora_scaling(lora.r, alpha, rslora)
        A = lora.lora_A.detach()
        for hf_name, B in _hf_parts(name, lora, cfg):
            # A copy per tensor: safetensors refuses tensors that share memory (the shared A, B's row views).
            tensors[f"{PREFIX}{hf_name}.lora_A.weight"] = A.clone()
            tensors[f"{PREFIX}{hf_name}.lora_B.weight"] = (B * fold if fold != 1.0 else B).clone(
                memory_format=torch.contiguous_format
            )
            targets.add(hf_name.rpartition(".")[2])
            if lora.r != r:
                rank_pattern[re.escape(hf_name)] = lora.r
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "use_rslora": rslora,
        "target_modules": sorted(targets),
        "rank_pattern": rank_pattern,
        "alpha_pattern": {},
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "inference_mode": True,
        "revision": None,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, out / PEFT_WEIGHTS)
    write_text_atomic(out / PEFT_CONFIG, json.dumps(config, indent=2) + "\n")
    return out


def _pattern_value(patterns: dict, module: str, default):
    # PEFT's rule (peft.utils.other.get_pattern_key): the first key that matches a dotted suffix.
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_supported(config: dict, where: Path) -> None:
    if config.get("peft_type") != "LORA":
        raise DataError(f"{where}: peft_type {config.get('peft_type')!r}: Kiln loads LORA adapters only")
    refusals = {
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out weights are not supported",
        "modules_to_save": "extra fully trained modules are not supported",
        "layers_to_transform": "LoRA on a subset of layers given by index is not supported; "
        "the adapter file lists the layers it changes",
        "lora_bias": "LoRA biases are not supported",
    }
    for key, why in refusals.items():
        if config.get(key):
            raise DataError(f"{where}: {key}={config[key]!r}: {why}")
    if config.get("bias", "none") != "none":
        raise DataError(f"{where}: bias={config['bias']!r}: trained biases are not supported")


def _stack(parts: list, names: tuple, sizes: list[int], fuse):
    """Fuse per-projection LoRAs (dict name -> (A, B, scale)) into one (A, B, scale) for Kiln's fused layer."""
    present = [n for n in names if n in parts]
    first_A, _, first_s = parts[present[0]]
    if len(present) == len(names) and all(torch.equal(parts[n][0], first_A) and parts[n][2] == first_s for n in names):
        return first_A, fuse([parts[n][1] for n in names]), first_s
    A = torch.cat([parts[n][0] for n in present])
    Bs, offset = [], 0
    for n, rows in zip(names, sizes):
        B = torch.zeros(rows, A.shape[0], dtype=A.dtype)
        if n in parts:
            a, b, s = parts[n]
            B[:, offset : offset + a.shape[0]] = b * (s / first_s)
            offset += a.shape[0]
        Bs.append(B)
    return A, fuse(Bs), first_s


def _embedding_weight(model: nn.Module, hf_module: str) -> tuple[str, torch.Tensor] | None:
    """(Kiln name, weight) of the base layer behind HF's lm_head or embed_tokens; None for other names."""
    kiln = _EMBEDDING_LAYERS.get(hf_module)
    if kiln == "output" and getattr(model, "output", None) is None:
        kiln = "tok_embeddings"  # tied: the head computes with the embedding matrix
    if kiln is None:
        return None
    module = model.get_submodule(kiln)
    return f"{kiln}.weight", (module.base if isinstance(module, LoRALinear) else module).weight


def _is_saved_base_weight(model: nn.Module, key: str, tensor: torch.Tensor, where: Path) -> bool:
    """Whether `key` is a copy of a base embedding/lm_head weight, which peft's save_pretrained adds
    (save_embedding_layers) when lm_head or embed_tokens is targeted. Kiln loads LoRA matrices onto
    the model's own weights, so the copy is checked to be those weights and otherwise refused."""
    match = re.fullmatch(r"(.+?)(?:\.base_layer)?\.weight", key.removeprefix(PREFIX))
    found = _embedding_weight(model, match.group(1)) if match else None
    if found is None:
        return False
    name, own = found
    if tensor.shape != own.shape or not torch.equal(tensor, own.detach().to(tensor.dtype)):
        raise DataError(
            f"{where}: {key} differs from the model's {name}: the adapter was saved with other base "
            f"weights, and Kiln puts LoRA matrices on the model's own; load it onto the model it was trained on"
        )
    return True


def load_peft_adapter(model: nn.Module, in_dir, model_cfg=None) -> nn.Module:
    """Put a Hugging Face PEFT LoRA adapter (for a Llama-layout model) onto a Kiln model: every layer
    it changes gets exactly that LoRA (wrapping it, or replacing an existing LoRA), all other weights are
    frozen. Works on a plain or an NF4-quantised (QLoRA) base. Copies of the base lm_head/embedding
    weights (peft's save_embedding_layers) are accepted when they equal the model's. Returns the model."""
    folder = Path(in_dir)
    cfg = model_cfg if model_cfg is not None else model.cfg
    config = read_json(folder / PEFT_CONFIG)
    _check_supported(config, folder / PEFT_CONFIG)
    weights_path = folder / PEFT_WEIGHTS
    tensors = read_safetensors(weights_path)
    r0, alpha0, rslora = config.get("r", 8), config.get("lora_alpha", 8), bool(config.get("use_rslora", False))
    dropout = float(config.get("lora_dropout", 0.0))
    modules: dict[str, dict] = {}
    for key, t in tensors.items():
        if _is_saved_base_weight(model, key, t, weights_path):
            continue
        match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key.removeprefix(PREFIX))
        if match is None:
            raise DataError(f"{weights_path}: tensor {key!r} is not a LoRA matrix Kiln can load")
        modules.setdefault(match.group(1), {})[match.group(2)] = t
    per_layer: dict[str, dict] = {}
    for hf_name, ab in modules.items():
        if set(ab) != {"A", "B"}:
            raise DataError(f"{weights_path}: {hf_name} has lora_{'A' if 'A' not in ab else 'B'} missing")
        A, B = ab["A"], ab["B"]
        rank = _pattern_value(config.get("rank_pattern") or {}, hf_name, r0)
        if A.shape[0] != rank:
            raise DataError(f"{weights_path}: {hf_name}.lora_A has rank {A.shape[0]}, the config says {rank}")
        scale = lora_scaling(rank, _pattern_value(config.get("alpha_pattern") or {}, hf_name, alpha0), rslora)
        if hf_name == "lm_head":
            per_layer.setdefault("output", {})["lm_head"] = (A, B, scale)
            continue
        match = _HF_LAYER.fullmatch(hf_name)
        if match is None:
            raise DataError(
                f"{weights_path}: LoRA on {hf_name!r}: Kiln maps only q/k/v/o_proj, gate/up/down_proj and lm_head"
            )
        layer, proj = match.groups()
        kiln = {
            "q": "attn.wqkv",
            "k": "attn.wqkv",
            "v": "attn.wqkv",
            "o": "attn.wo",
            "gate": "ffn.w1",
            "up": "ffn.w3",
            "down": "ffn.w2",
        }[proj]
        per_layer.setdefault(f"layers.{layer}.{kiln}", {})[f"{proj}_proj"] = (A, B, scale)
    others = sorted(set(lora_modules(model)) - set(per_layer))
    if others:
        raise ValueError(
            f"the model has LoRA layers the adapter does not cover ({', '.join(others[:4])}); "
            f"load it onto a model without LoRA"
        )
    q_rows, kv_rows = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for name, parts in per_layer.items():
        try:
            model.get_submodule(name)
        except AttributeError:
            raise DataError(f"{weights_path}: the adapter changes {name!r}, which this model does not have") from None
        if name.endswith("attn.wqkv"):
            A, B, s = _stack(parts, QKV, [q_rows, kv_rows, kv_rows], lambda bs: fuse_qkv(*bs, cfg.kv_heads))
        else:
            A, B, s = next(iter(parts.values()))
        set_lora(model, name, A, B, s, dropout)
    _freeze_all_but_peft(model)
    return model
