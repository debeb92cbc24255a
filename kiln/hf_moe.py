"""Mixture-of-Experts models as Hugging Face Mixtral or Qwen2-MoE folders (docs/hf.md, docs/moe.md).

kiln/hf.py does the folder, the attention and the dense layers; this module maps the MoE layers and
the MoE keys of config.json, both ways.

Which class: both HF routers compute p = softmax(router(x)) in float32, take the top-k of p, and run
dropless SwiGLU experts, as Kiln does. Mixtral always divides the k gates by their sum and has MoE
in every layer, no shared expert and no attention biases; a Kiln model with exactly that exports as
`MixtralForCausalLM`. Every other Kiln MoE model exports as `Qwen2MoeForCausalLM`, whose
`norm_topk_prob`, `decoder_sparse_step` and `mlp_only_layers` express the raw-gate and dense-layer
variants. Qwen2-MoE always has a shared expert and q/k/v biases, and gates the shared expert with
sigmoid(w·x), which Kiln's has not; exact equivalents are written instead:
- no Kiln shared expert: a shared expert of width 0 (it adds exactly 0);
- Kiln's shared expert: its weights with down_proj doubled and a zero gate vector, since
  sigmoid(0) = 0.5 and doubling then halving is exact in floating point;
- no Kiln q/k/v biases: zero biases (transformers 4.x and vLLM read Qwen2-MoE's biases
  unconditionally).
Import undoes these: a gated shared expert is refused unless its gate is zero.

Refused: capacity drops (`moe_capacity_factor > 0`), which no HF MoE class has. The router z-loss
and Kiln's capacity have no config key in either class; import sets them to 0 (dropless, no z-loss),
what HF's training computes.

Load-balancing loss: HF's `load_balancing_loss_func` pools the router logits of all L MoE layers
and counts the k choices of a token separately (its f sums to k), so it is k times Kiln's loss for
one layer. `router_aux_loss_coef = moe_aux_loss_weight * L / k` makes HF's added term equal Kiln's
for L = 1 and equal at balance (and in per-layer gradient scale) for L > 1.
"""

from __future__ import annotations

from typing import Callable

import torch

from kiln.errors import ConfigError, DataError
from kiln.model.config import ModelConfig

MOE_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# (router, expert gate, up, down) tensor names under model.layers.{i}.
_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.{p}.weight", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp.gate.weight", "mlp.experts.{e}.{p}.weight", ("gate_proj", "up_proj", "down_proj")),
}
_SHARED = "mlp.shared_expert.{p}.weight"
_SHARED_GATE = "mlp.shared_expert_gate.weight"


def moe_layer_ids(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]


def moe_model_type(cfg: ModelConfig) -> str | None:
    """The HF model_type a Kiln MoE model exports as; None for a dense model."""
    layers = moe_layer_ids(cfg)
    if not layers:
        return None
    if cfg.moe_capacity_factor > 0:
        raise ConfigError(
            "moe_capacity_factor",
            f"is {cfg.moe_capacity_factor}: Mixtral and Qwen2-MoE are dropless, so exported logits would differ "
            "wherever an expert overflows; only dropless (0) MoE models export",
        )
    mixtral = len(layers) == cfg.n_layers and cfg.moe_norm_topk and not cfg.moe_shared_expert and not cfg.qkv_bias
    return "mixtral" if mixtral else "qwen2_moe"


def moe_config_fields(cfg: ModelConfig) -> dict:
    """The MoE keys of config.json ({} for a dense model)."""
    model_type = moe_model_type(cfg)
    if model_type is None:
        return {}
    layers = moe_layer_ids(cfg)
    fields = {
        "num_experts_per_tok": cfg.moe_top_k,
        "router_aux_loss_coef": cfg.moe_aux_loss_weight * len(layers) / cfg.moe_top_k,
        # HF's training adds the aux loss only when the forward returns the router logits.
        "output_router_logits": cfg.moe_aux_loss_weight > 0,
    }
    if model_type == "mixtral":
        return {
            **fields,
            "num_local_experts": cfg.n_experts,
            "intermediate_size": cfg.moe_hidden_size,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    # moe_every is Qwen2-MoE's decoder_sparse_step (both count layers from 1); an explicit layer list
    # becomes the complement, mlp_only_layers.
    explicit = bool(cfg.moe_layers)
    return {
        **fields,
        "num_experts": cfg.n_experts,
        "moe_intermediate_size": cfg.moe_hidden_size,
        "shared_expert_intermediate_size": cfg.moe_hidden_size if cfg.moe_shared_expert else 0,
        "norm_topk_prob": cfg.moe_norm_topk,
        "decoder_sparse_step": 1 if explicit else cfg.moe_every,
        "mlp_only_layers": [i for i in range(cfg.n_layers) if i not in layers] if explicit else [],
        "qkv_bias": True,
    }


def moe_layer_to_hf(cfg: ModelConfig, layer: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors of MoE layer `layer`'s feed-forward (router, experts, Qwen2-MoE's shared expert)."""
    model_type = moe_model_type(cfg)
    src, dst = f"layers.{layer}.ffn.", f"model.layers.{layer}."
    router, expert, parts = _NAMES[model_type]
    out = {dst + router: state[f"{src}router.weight"]}
    w1, w3, w2 = (state[f"{src}experts.{w}"] for w in ("w1", "w3", "w2"))
    for e in range(cfg.n_experts):
        for part, t in zip(parts, (w1[e], w3[e], w2[e])):
            out[dst + expert.format(e=e, p=part)] = t
    if model_type == "mixtral":
        return out
    if cfg.moe_shared_expert:
        gate, up = state[f"{src}shared_expert.w1.weight"], state[f"{src}shared_expert.w3.weight"]
        down = state[f"{src}shared_expert.w2.weight"] * 2  # times sigmoid(0) = 0.5 gives it back exactly
    else:
        w = state[f"{src}router.weight"]
        gate, up, down = w.new_zeros(0, cfg.dim), w.new_zeros(0, cfg.dim), w.new_zeros(cfg.dim, 0)
    for part, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        out[dst + _SHARED.format(p=part)] = t
    out[dst + _SHARED_GATE] = state[f"{src}router.weight"].new_zeros(1, cfg.dim)
    return out


def dense_layer_biases(cfg: ModelConfig, layer: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero q/k/v biases for a Qwen2-MoE export of a Kiln model without them ({} otherwise)."""
    if cfg.qkv_bias or moe_model_type(cfg) != "qwen2_moe":
        return {}
    sizes = {"q_proj": cfg.n_heads * cfg.head_dim, "k_proj": cfg.kv_heads * cfg.head_dim}
    sizes["v_proj"] = sizes["k_proj"]
    return {f"model.layers.{layer}.self_attn.{p}.bias": like.new_zeros(n) for p, n in sizes.items()}


def moe_config_from_hf(hf: dict, where: str) -> dict:
    """ModelConfig keys of a Mixtral or Qwen2-MoE config.json ({} for other model types)."""
    model_type = hf.get("model_type")
    if model_type not in MOE_ARCHITECTURES:
        return {}

    def refuse(key: str, why: str):
        raise DataError(f"{where}: {key}={hf.get(key)!r}: {why}")

    # Missing keys take the defaults of transformers' config classes.
    n_layers, top_k = hf["num_hidden_layers"], hf.get("num_experts_per_tok", 2 if model_type == "mixtral" else 4)
    kwargs = {"moe_top_k": top_k, "moe_capacity_factor": 0.0, "moe_z_loss_weight": 0.0}
    if model_type == "mixtral":
        if hf.get("router_jitter_noise"):
            refuse("router_jitter_noise", "Kiln's router has no input jitter")
        moe_layers = list(range(n_layers))
        kwargs.update(n_experts=hf.get("num_local_experts", 8), moe_norm_topk=True, moe_hidden=hf["intermediate_size"])
        kwargs["moe_every"] = 1
    else:
        moe_hidden = hf.get("moe_intermediate_size", 1408)
        shared = hf.get("shared_expert_intermediate_size", 5632)
        if shared not in (0, moe_hidden):
            refuse("shared_expert_intermediate_size", f"Kiln's shared expert is as wide as a routed one ({moe_hidden})")
        step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        moe_layers = [i for i in range(n_layers) if i not in only and (i + 1) % step == 0]
        if hf.get("num_experts", 60) == 0:
            moe_layers = []
        # Kiln's moe_every is decoder_sparse_step; mlp_only_layers needs the explicit list.
        if only:
            kwargs["moe_layers"] = moe_layers
        else:
            kwargs["moe_every"] = step
        kwargs.update(
            n_experts=hf.get("num_experts", 60),
            moe_hidden=moe_hidden,
            moe_shared_expert=shared > 0,
            moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
            qkv_bias=bool(hf.get("qkv_bias", True)),
        )
    if not moe_layers:
        return {key: value for key, value in kwargs.items() if key == "qkv_bias"}
    coef = hf.get("router_aux_loss_coef", 0.001)
    kwargs.update(moe_aux_loss_weight=coef * top_k / len(moe_layers))
    return kwargs


def moe_layer_from_hf(
    cfg: ModelConfig, layer: int, take: Callable[[str], torch.Tensor], has: Callable[[str], bool], where: str
) -> dict[str, torch.Tensor]:
    """Kiln tensors of MoE layer `layer`'s feed-forward; `take(name)` reads (and marks used) an HF tensor."""
    src, dst = f"model.layers.{layer}.", f"layers.{layer}.ffn."
    model_type = "mixtral" if has(src + _NAMES["mixtral"][0]) else "qwen2_moe"
    router, expert, parts = _NAMES[model_type]
    per_expert = [[take(src + expert.format(e=e, p=part)) for part in parts] for e in range(cfg.n_experts)]
    out = {f"{dst}router.weight": take(src + router)}
    for w, weights in zip(("w1", "w3", "w2"), zip(*per_expert)):
        out[f"{dst}experts.{w}"] = torch.stack(weights)
    if model_type == "mixtral":
        return out
    gate, up, down = (take(src + _SHARED.format(p=part)) for part in ("gate_proj", "up_proj", "down_proj"))
    shared_gate = take(src + _SHARED_GATE)
    if cfg.moe_shared_expert:
        if shared_gate.count_nonzero():
            raise DataError(
                f"{where}: {src + _SHARED_GATE} is not zero: Kiln's shared expert has no sigmoid gate, so only "
                "Qwen2-MoE checkpoints whose shared-expert gate is zero (sigmoid = 0.5) import"
            )
        out[f"{dst}shared_expert.w1.weight"], out[f"{dst}shared_expert.w3.weight"] = gate, up
        out[f"{dst}shared_expert.w2.weight"] = down / 2
    return out
