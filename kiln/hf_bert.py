"""Kiln BERT <-> transformers BERT: config.json and tensor names, both ways.

kiln/hf.py writes and reads the folders (safetensors, tokenizer, `kiln export hf` / `kiln import hf`)
and asks this module for the mapping when the checkpoint's model_config says arch = "bert" or the
folder's config.json says model_type = "bert". A masked-LM model exports as BertForMaskedLM, a
classifier (num_labels > 0) as BertForSequenceClassification.

The only reshaping is Kiln's fused `wqkv`, whose rows are all of q, then k, then v (kiln/model/bert.py);
transformers keeps query, key and value apart. The masked-LM decoder is tied to the word embeddings
in both, so neither file stores it (an older checkpoint that does must hold the tied copy).
"""

from __future__ import annotations

import torch

from kiln.errors import DataError
from kiln.hf_tensors import TensorTaker
from kiln.model.bert_config import BertConfig

MASKED_LM, CLASSIFIER = "BertForMaskedLM", "BertForSequenceClassification"


def _pairs(cfg: BertConfig) -> list[tuple[str, str]]:
    """(Kiln name, transformers name) of every tensor but the fused q/k/v."""
    pairs = [
        ("tok_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
        ("pos_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
        ("type_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"),
    ]
    norms = [("embed_norm", "bert.embeddings.LayerNorm")]
    linears = []
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"bert.encoder.layer.{i}."
        linears += [
            (f"{src}attn.wo", f"{dst}attention.output.dense"),
            (f"{src}ffn.w1", f"{dst}intermediate.dense"),
            (f"{src}ffn.w2", f"{dst}output.dense"),
        ]
        norms += [(f"{src}attn_norm", f"{dst}attention.output.LayerNorm"), (f"{src}ffn_norm", f"{dst}output.LayerNorm")]
    if cfg.num_labels:
        linears += [("output.pooler", "bert.pooler.dense"), ("output.classifier", "classifier")]
    else:
        linears.append(("output.dense", "cls.predictions.transform.dense"))
        norms.append(("output.norm", "cls.predictions.transform.LayerNorm"))
        pairs.append(("output.bias", "cls.predictions.bias"))
    for kiln_name, hf_name in linears + norms:
        pairs += [(f"{kiln_name}.weight", f"{hf_name}.weight"), (f"{kiln_name}.bias", f"{hf_name}.bias")]
    return pairs


QKV = ("query", "key", "value")


def kiln_to_hf_state(cfg: BertConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {hf_name: state[kiln_name] for kiln_name, hf_name in _pairs(cfg)}
    for i in range(cfg.n_layers):
        for suffix in ("weight", "bias"):
            parts = state[f"layers.{i}.attn.wqkv.{suffix}"].chunk(3)
            for name, t in zip(QKV, parts):
                out[f"bert.encoder.layer.{i}.attention.self.{name}.{suffix}"] = t
    # .contiguous() copies the q/k/v row slices: safetensors refuses views into a larger tensor.
    return {name: t.detach().contiguous() for name, t in out.items()}


def hf_to_kiln_state(cfg: BertConfig, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    take = TensorTaker(tensors, where)
    out = {kiln_name: take(hf_name) for kiln_name, hf_name in _pairs(cfg)}
    for i in range(cfg.n_layers):
        for suffix in ("weight", "bias"):
            parts = [take(f"bert.encoder.layer.{i}.attention.self.{name}.{suffix}") for name in QKV]
            out[f"layers.{i}.attn.wqkv.{suffix}"] = torch.cat(parts)
    # A stored copy of the tied decoder is the embedding matrix and the bias again; anything else is
    # a layer Kiln's BERT has no place for (a next-sentence head, a pooler on a masked-LM model).
    if not cfg.num_labels:
        for name, tied in (
            ("cls.predictions.decoder.weight", out["tok_embeddings.weight"]),
            ("cls.predictions.decoder.bias", out["output.bias"]),
        ):
            take.take_copy(name, tied, "the tensor it is tied to", "Kiln's BERT ties them")
    take.refuse_leftovers("Kiln's BERT", lambda n: n.endswith("position_ids"))
    return out


def hf_config(cfg: BertConfig, pad_token_id: int | None) -> dict:
    """config.json of a Kiln BERT (the caller adds dtype and the tokenizer's special ids)."""
    config = {
        "architectures": [CLASSIFIER if cfg.num_labels else MASKED_LM],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.ffn_hidden_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.type_vocab_size,
        "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.norm_eps,
        "position_embedding_type": "absolute",  # transformers 4.x reads it; 5.x has absolute only
        "tie_word_embeddings": True,
        "is_decoder": False,
    }
    if pad_token_id is not None:
        config["pad_token_id"] = pad_token_id
    if cfg.num_labels:
        config["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
        config["label2id"] = {f"LABEL_{i}": i for i in range(cfg.num_labels)}
    return config


def config_from_hf(hf: dict, where: str) -> BertConfig:
    """A BERT config.json as a BertConfig, refusing what Kiln's BERT cannot represent."""

    def refuse(key: str, why: str):
        raise DataError(f"{where}: {key}={hf.get(key)!r}: {why}")

    if hf.get("hidden_act", "gelu") != "gelu":
        refuse("hidden_act", "Kiln's BERT has the exact (erf) GELU only")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        refuse("position_embedding_type", "Kiln's BERT has learned absolute positions only")
    for key in ("is_decoder", "add_cross_attention"):
        if hf.get(key):
            refuse(key, "Kiln's BERT is an encoder (bidirectional, no cross-attention)")
    if hf.get("classifier_dropout") not in (None, hf.get("hidden_dropout_prob", 0.1)):
        refuse("classifier_dropout", "Kiln's classifier uses hidden_dropout_prob (model.dropout)")
    if hf.get("tie_word_embeddings", True) is False:
        refuse("tie_word_embeddings", "Kiln's masked-LM decoder is tied to the word embeddings")
    architectures = hf.get("architectures") or [MASKED_LM]
    if architectures[0] not in (MASKED_LM, CLASSIFIER):
        refuse("architectures", f"Kiln imports {MASKED_LM} and {CLASSIFIER} folders")
    num_labels = len(hf.get("id2label") or {0: 0, 1: 1}) if architectures[0] == CLASSIFIER else 0
    cfg = BertConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        ffn_hidden=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 512),
        type_vocab_size=hf.get("type_vocab_size", 2),
        norm_eps=hf.get("layer_norm_eps", 1e-12),
        dropout=hf.get("hidden_dropout_prob", 0.1),
        attn_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        init_std=hf.get("initializer_range", 0.02),
        num_labels=num_labels,
    )
    cfg.validate()
    return cfg
