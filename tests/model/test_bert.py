"""Kiln's BERT against transformers' BertForMaskedLM and BertForSequenceClassification, built from
the same config with the same (random) weights, and its config's refusals."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from kiln_testing.models import randomise  # noqa: E402

from kiln.errors import ConfigError  # noqa: E402
from kiln.hf_bert import hf_to_kiln_state  # noqa: E402
from kiln.model import build_model, count_params  # noqa: E402
from kiln.model.bert import Bert  # noqa: E402
from kiln.model.bert_config import BertConfig  # noqa: E402

SHAPE = dict(vocab_size=97, dim=48, n_layers=2, n_heads=4, ffn_hidden=80, max_seq_len=32, type_vocab_size=2)


def hf_config(cfg: BertConfig):
    return transformers.BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.ffn_hidden_size,
        max_position_embeddings=cfg.max_seq_len,
        type_vocab_size=cfg.type_vocab_size,
        layer_norm_eps=cfg.norm_eps,
        num_labels=max(cfg.num_labels, 2),
    )


def pair(num_labels: int = 0, **extra):
    """(Kiln model, transformers model) with transformers' random weights copied into Kiln's."""
    cfg = BertConfig(**SHAPE, num_labels=num_labels, **extra)
    hf_cls = transformers.BertForSequenceClassification if num_labels else transformers.BertForMaskedLM
    torch.manual_seed(0)
    hf = randomise(hf_cls(hf_config(cfg))).eval()
    with torch.no_grad():  # randomise keys on "norm"; transformers spells it LayerNorm
        for name, p in hf.named_parameters():
            if "LayerNorm.weight" in name:
                p.uniform_(0.5, 1.5)
    model = build_model(cfg).eval()
    model.load_state_dict(hf_to_kiln_state(cfg, hf.state_dict(), "hf"))
    return model, hf


def inputs():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (3, 20), generator=g)
    types = torch.randint(0, 2, (3, 20), generator=g)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 13:] = 0  # rows of different lengths: padding must be hidden from every query
    mask[2, 5:] = 0
    return tokens, mask, types


@pytest.mark.parametrize("num_labels", [0, 3])
def test_logits_match_transformers_with_padding(num_labels):
    model, hf = pair(num_labels)
    tokens, mask, types = inputs()
    with torch.no_grad():
        ours = model(tokens, attention_mask=mask, token_type_ids=types)
        theirs = hf(input_ids=tokens, attention_mask=mask, token_type_ids=types).logits
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
        # No mask, no types: transformers' defaults (attend everywhere, segment 0).
        torch.testing.assert_close(model(tokens), hf(input_ids=tokens).logits, rtol=1e-4, atol=1e-4)


def test_padding_changes_nothing_for_the_real_tokens():
    model, _ = pair()
    tokens, mask, _ = inputs()
    garbage = tokens.clone()
    garbage[mask == 0] = 7  # other tokens where the mask says padding
    with torch.no_grad():
        a, b = model(tokens, attention_mask=mask), model(garbage, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep])
    assert not torch.allclose(model(tokens)[keep], a[keep])  # without the mask the padding is seen


def test_attention_is_bidirectional():
    model, _ = pair()
    tokens, _, _ = inputs()
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % SHAPE["vocab_size"]
    with torch.no_grad():
        assert not torch.allclose(model(tokens)[:, 0], model(changed)[:, 0])  # the first token sees the last


def test_dropout_acts_in_training_only():
    model = build_model(BertConfig(**SHAPE, dropout=0.3, attn_dropout=0.3))
    tokens, _, _ = inputs()
    model.train()
    assert not torch.allclose(model(tokens), model(tokens))
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens))


def test_parameter_count_matches_the_module():
    for num_labels in (0, 5):
        cfg = BertConfig(**SHAPE, num_labels=num_labels)
        model = build_model(cfg)
        assert count_params(cfg) == sum(p.numel() for p in model.parameters())
        embeddings = sum(
            model.get_submodule(m).weight.numel() for m in ("tok_embeddings", "pos_embeddings", "type_embeddings")
        )
        assert count_params(cfg, non_embedding=True) == count_params(cfg) - embeddings
    hf = transformers.BertForMaskedLM(hf_config(BertConfig(**SHAPE)))
    assert count_params(BertConfig(**SHAPE)) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize(
    "bad,key",
    [
        ({"n_heads": 5}, "n_heads"),
        ({"dim": 0}, "dim"),
        ({"dropout": 1.0}, "dropout"),
        ({"attn_dropout": -0.1}, "attn_dropout"),
        ({"norm_eps": float("nan")}, "norm_eps"),
        ({"num_labels": -1}, "num_labels"),
        ({"type_vocab_size": 0}, "type_vocab_size"),
        ({"arch": "decoder"}, "arch"),
    ],
)
def test_config_refuses_by_name(bad, key):
    with pytest.raises(ConfigError) as err:
        Bert(BertConfig(**{**SHAPE, **bad}))
    assert err.value.key == key


def test_recipe_arch_picks_the_family():
    from pathlib import Path

    from kiln.recipe import load_recipe

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-bert.toml"
    assert isinstance(load_recipe(recipe).model, BertConfig)
    assert type(load_recipe(None, ["model.arch=decoder"]).model).__name__ == "ModelConfig"
    for override, key in [
        ("model.arch=gpt", "model.arch"),
        ("model.n_kv_heads=2", "model.n_kv_heads"),  # a decoder key is no BERT key
        ('run.stages=["pretrain","sample"]', "run.stages"),  # a BERT does not generate
    ]:
        with pytest.raises(ConfigError) as err:
            load_recipe(recipe, [override])
        assert err.value.key == key
