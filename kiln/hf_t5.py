"""Kiln's T5 (kiln/model/t5.py) <-> transformers' T5ForConditionalGeneration: tensor names and
config.json, both ways. The files themselves (safetensors, tokenizer, the verbs) are kiln/hf.py's,
which calls these when a checkpoint's arch is "t5" or a folder's model_type is "t5".

transformers 5 ties T5's head to the shared embedding whatever the config says; its
`tie_word_embeddings` (or `scale_decoder_outputs`) only selects the d_model**-0.5 rescaling of the
decoder output. Kiln's T5 has the same single matrix, so an import refuses a folder whose stored
lm_head differs from its embedding rather than dropping one of the two.
"""

from __future__ import annotations

import torch

from kiln.errors import ConfigError, DataError
from kiln.hf_tensors import TensorTaker
from kiln.model.t5_config import T5Config

ARCHITECTURE = "T5ForConditionalGeneration"


def _block_names(cfg: T5Config) -> list[tuple[str, str]]:
    """(Kiln name, transformers name) of every tensor but the embedding."""
    ffn = [("w1", "wi_0"), ("w3", "wi_1"), ("w2", "wo")] if cfg.ffn == "gated-gelu" else [("w1", "wi"), ("w2", "wo")]
    pairs = []
    for stack, n_layers in (("encoder", cfg.n_layers), ("decoder", cfg.decoder_layers)):
        decoder = stack == "decoder"
        pairs += [(f"{stack}.norm.weight", f"{stack}.final_layer_norm.weight")]
        pairs += [(f"{stack}.rel_bias.weight", f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")]
        for i in range(n_layers):
            src, dst = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
            ffn_layer = 2 if decoder else 1
            pairs += [(f"{src}attn.{p}.weight", f"{dst}0.SelfAttention.{p}.weight") for p in "qkvo"]
            pairs += [(f"{src}attn_norm.weight", f"{dst}0.layer_norm.weight")]
            if decoder:
                pairs += [(f"{src}cross.{p}.weight", f"{dst}1.EncDecAttention.{p}.weight") for p in "qkvo"]
                pairs += [(f"{src}cross_norm.weight", f"{dst}1.layer_norm.weight")]
            pairs += [(f"{src}ffn.{k}.weight", f"{dst}{ffn_layer}.DenseReluDense.{h}.weight") for k, h in ffn]
            pairs += [(f"{src}ffn_norm.weight", f"{dst}{ffn_layer}.layer_norm.weight")]
    return pairs


def t5_to_hf_state(cfg: T5Config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"shared.weight": state["embed.weight"]}
    out.update({hf: state[kiln] for kiln, hf in _block_names(cfg)})
    return {name: t.detach().contiguous() for name, t in out.items()}


def hf_to_t5_state(cfg: T5Config, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    take = TensorTaker(tensors, where)
    embed = take("shared.weight")
    out = {"embed.weight": embed}
    out.update({kiln: take(hf) for kiln, hf in _block_names(cfg)})
    # Copies of the shared embedding that older transformers versions stored beside it.
    copies = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")
    for name in copies:
        take.take_copy(
            name,
            embed,
            "shared.weight",
            "Kiln's T5 (like transformers 5) has one matrix for the embeddings and the head, so an untied "
            "head cannot be imported",
        )
    take.refuse_leftovers("Kiln's T5")
    return out


def t5_hf_config(cfg: T5Config, dtype_name: str) -> dict:
    """config.json of a Kiln T5. Dropout is 0: Kiln trains without it, and the exported model then
    computes what Kiln's does in train mode too."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "t5",
        "is_encoder_decoder": True,
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.dim,
        "d_kv": cfg.head_dim,
        "d_ff": cfg.ffn_hidden,
        "num_layers": cfg.n_layers,
        "num_decoder_layers": cfg.decoder_layers,
        "num_heads": cfg.n_heads,
        "relative_attention_num_buckets": cfg.rel_buckets,
        "relative_attention_max_distance": cfg.rel_max_distance,
        "feed_forward_proj": cfg.ffn,
        "layer_norm_epsilon": cfg.norm_eps,
        "dropout_rate": 0.0,
        "initializer_factor": cfg.init_factor,
        # transformers 5 reads the scaling from here (tie_word_embeddings: false -> no scaling) and
        # ties the head regardless; scale_decoder_outputs says the same thing explicitly.
        "tie_word_embeddings": cfg.scale_logits,
        "scale_decoder_outputs": cfg.scale_logits,
        "n_positions": cfg.max_seq_len,
        "pad_token_id": cfg.pad_id,
        "eos_token_id": cfg.eos_id,
        "decoder_start_token_id": cfg.pad_id,
        "torch_dtype": dtype_name,
        "use_cache": True,
    }


def _int_id(hf: dict, key: str, default: int, where: str) -> int:
    value = hf.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise DataError(f"{where}: {key}={value!r}: Kiln's T5 takes one token id here")
    return value


def t5_config_from_hf(hf: dict, where: str) -> T5Config:
    """A T5Config from a transformers T5 config.json, refusing what Kiln's T5 cannot represent."""
    feed_forward = hf.get("feed_forward_proj", "relu")
    if feed_forward not in ("gated-gelu", "relu"):
        raise DataError(f"{where}: feed_forward_proj={feed_forward!r}: Kiln's T5 has gated-gelu and relu")
    pad = _int_id(hf, "pad_token_id", 0, where)
    start = _int_id(hf, "decoder_start_token_id", pad, where)
    if start != pad:
        raise DataError(
            f"{where}: decoder_start_token_id={start} differs from pad_token_id={pad}; Kiln's T5 starts at pad"
        )
    scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
    cfg = T5Config(
        vocab_size=hf["vocab_size"],
        dim=hf["d_model"],
        n_heads=hf["num_heads"],
        head_dim=hf["d_kv"],
        ffn_hidden=hf["d_ff"],
        ffn=feed_forward,
        n_layers=hf["num_layers"],
        n_decoder_layers=hf.get("num_decoder_layers") or 0,
        rel_buckets=hf.get("relative_attention_num_buckets", 32),
        rel_max_distance=hf.get("relative_attention_max_distance", 128),
        norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        scale_logits=bool(scale),
        max_seq_len=hf.get("n_positions") or 512,
        pad_id=pad,
        eos_id=_int_id(hf, "eos_token_id", 1, where),
        init_factor=hf.get("initializer_factor", 1.0),
    )
    try:
        cfg.validate()
    except ConfigError as err:
        raise DataError(f"{where}: {err}") from None
    return cfg
