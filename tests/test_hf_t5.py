"""T5 both ways with transformers: a Kiln T5 exported as an HF folder loads in
AutoModelForSeq2SeqLM with the same logits, and a T5 folder saved by transformers imports into a
Kiln checkpoint (through `kiln import hf`) with the same logits."""

import json

import pytest
import torch

from kiln.checkpoint import read_safetensors, save_weights, write_safetensors
from kiln.cli import main
from kiln.errors import DataError
from kiln.hf import export_checkpoint_to_hf, import_hf
from kiln.peft.load import load_model
from tests.model.test_t5 import TINY, batch, make

transformers = pytest.importorskip("transformers")


def logits(model, hf=False):
    src, tgt, src_mask, tgt_mask = batch(TINY)
    with torch.no_grad():
        if hf:
            return hf_logits(model, src, tgt, src_mask, tgt_mask)
        return model(src, tgt, src_mask, tgt_mask)


def hf_logits(model, src, tgt, src_mask, tgt_mask):
    return model(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask).logits


@pytest.mark.parametrize("scale_logits", [True, False])
def test_export_loads_in_transformers_with_identical_logits(tmp_path, scale_logits):
    import dataclasses

    model = make(dataclasses.replace(TINY, scale_logits=scale_logits), seed=5)
    ckpt = save_weights(tmp_path / "ckpt", model.cfg, model.state_dict(), {"step": 3})
    out = export_checkpoint_to_hf(ckpt, None, tmp_path / "hf")
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "T5ForConditionalGeneration"
    assert hf.config.scale_decoder_outputs is scale_logits
    torch.testing.assert_close(logits(hf, hf=True), logits(model), atol=1e-5, rtol=1e-5)


def test_transformers_folder_imports_through_the_cli(tmp_path):
    config = transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=12, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False, pad_token_id=1, eos_token_id=0, decoder_start_token_id=1, n_positions=64,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "kiln")]) == 0
    model, manifest = load_model(tmp_path / "kiln")
    assert type(model).__name__ == "T5" and manifest["model_config"]["arch"] == "t5"
    assert model.cfg.scale_logits is False and model.cfg.decoder_layers == 3
    torch.testing.assert_close(logits(model), logits(hf, hf=True), atol=1e-5, rtol=1e-5)


def test_untied_head_and_unknown_tensors_are_refused(tmp_path):
    model = make(seed=1)
    ckpt = save_weights(tmp_path / "ckpt", model.cfg, model.state_dict(), {"step": 0})
    out = export_checkpoint_to_hf(ckpt, None, tmp_path / "hf")
    tensors = read_safetensors(out / "model.safetensors")
    write_safetensors({**tensors, "lm_head.weight": tensors["shared.weight"] + 1}, out / "model.safetensors")
    with pytest.raises(DataError, match="lm_head.weight differs from shared.weight"):
        import_hf(out)
    write_safetensors(
        {**tensors, "encoder.block.0.layer.0.SelfAttention.q.bias": torch.zeros(32)}, out / "model.safetensors"
    )
    with pytest.raises(DataError, match="no place for: encoder.block.0.layer.0.SelfAttention.q.bias"):
        import_hf(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "feed_forward_proj": "gated-silu"}))
    with pytest.raises(DataError, match="feed_forward_proj='gated-silu'"):
        import_hf(out)
