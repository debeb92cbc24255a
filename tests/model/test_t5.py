"""Kiln's T5 against transformers' T5ForConditionalGeneration built from the same config, with the
same weights: logits in fp32, with padding in the encoder and the decoder."""

import dataclasses

import pytest
import torch

from kiln.hf_t5 import t5_hf_config, t5_to_hf_state
from kiln.model.t5 import T5, relative_position_bucket
from kiln.model.t5_config import T5Config

transformers = pytest.importorskip("transformers")

TINY = T5Config(
    vocab_size=96,
    dim=32,
    n_heads=4,
    head_dim=8,
    ffn_hidden=48,
    n_layers=2,
    n_decoder_layers=3,
    rel_buckets=8,
    rel_max_distance=12,
    max_seq_len=64,
)


def hf_twin(model: T5):
    """transformers' T5 with the config and weights of a Kiln T5, in eval mode."""
    config = transformers.T5Config(
        **{k: v for k, v in t5_hf_config(model.cfg, "float32").items() if k != "architectures"}
    )
    hf = transformers.T5ForConditionalGeneration(config).eval()
    missing, unexpected = hf.load_state_dict(t5_to_hf_state(model.cfg, model.state_dict()), strict=False)
    assert not unexpected
    assert set(missing) <= {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
    return hf


def make(cfg: T5Config = TINY, seed: int = 0) -> T5:
    torch.manual_seed(seed)
    return T5(cfg).eval()


def batch(cfg: T5Config, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(2, cfg.vocab_size, (3, 20), generator=g)
    tgt = torch.randint(2, cfg.vocab_size, (3, 9), generator=g)
    # Rows of different lengths: padding at the end of the encoder input and of the decoder input.
    src_mask = torch.ones_like(src)
    src_mask[1, 14:] = 0
    src_mask[2, 5:] = 0
    tgt_mask = torch.ones_like(tgt)
    tgt_mask[2, 6:] = 0
    return src, tgt, src_mask, tgt_mask


@pytest.mark.parametrize(
    "overrides",
    [{}, {"ffn": "relu", "scale_logits": False}, {"rel_buckets": 32, "rel_max_distance": 128, "n_decoder_layers": 0}],
    ids=["v1.1", "relu-unscaled", "default-buckets"],
)
def test_logits_match_transformers_with_padding(overrides):
    cfg = dataclasses.replace(TINY, **overrides)
    model = make(cfg)
    hf = hf_twin(model)
    src, tgt, src_mask, tgt_mask = batch(cfg)
    with torch.no_grad():
        ours = model(src, tgt, src_mask, tgt_mask)
        theirs = hf(
            input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask
        ).logits
    assert ours.shape == theirs.shape
    real = tgt_mask.bool()  # logits of padded decoder positions are never used
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-4, rtol=1e-4)


def test_padding_changes_what_the_model_sees():
    """The masks have an effect: without the encoder mask the padded keys change the real rows."""
    model = make()
    src, tgt, src_mask, _ = batch(TINY)
    with torch.no_grad():
        masked = model(src, tgt, src_mask)
        unmasked = model(src, tgt)
    assert torch.equal(masked[0], unmasked[0])  # row 0 has no padding
    assert not torch.allclose(masked[2], unmasked[2], atol=1e-3)


def test_buckets_against_worked_values():
    """T5's bucket function at hand-checked points: 16 buckets, max distance 32, bidirectional.
    Half (8) per direction; distances 0..3 exact, 4..31 log-spaced over buckets 4..7."""
    rel = torch.tensor([0, 1, 3, 4, 7, 8, 31, 500, -1, -4, -500])
    got = relative_position_bucket(rel, True, 16, 32).tolist()
    # key after the query (rel > 0) adds 8; bucket(d) = 4 + floor(log(d/4)/log(8) * 4) for d >= 4
    assert got == [0, 9, 11, 12, 13, 13, 15, 15, 1, 4, 7]  # d=7: floor(1.08), d=8: floor(1.33)
    causal = relative_position_bucket(torch.tensor([2, 0, -1, -8, -16, -100]), False, 16, 32).tolist()
    # causal: all 16 buckets on one side, 8 exact; d=16: 8 + floor(log(2)/log(4) * 8) = 12
    assert causal == [0, 0, 1, 8, 12, 15]


def test_refuses_bad_config_by_name():
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError, match="ffn"):
        dataclasses.replace(TINY, ffn="swiglu").validate()
    with pytest.raises(ConfigError, match="rel_max_distance"):
        dataclasses.replace(TINY, rel_buckets=32, rel_max_distance=16).validate()
    with pytest.raises(ConfigError, match="pad_id"):
        dataclasses.replace(TINY, pad_id=96).validate()
