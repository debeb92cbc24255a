"""Kiln BERT checkpoints out to transformers folders and back, through `kiln export hf` / `kiln import hf`."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from kiln_testing.models import randomise  # noqa: E402

from kiln.checkpoint import save_weights  # noqa: E402
from kiln.cli import main  # noqa: E402
from kiln.errors import DataError  # noqa: E402
from kiln.hf import export_hf, import_hf  # noqa: E402
from kiln.model import build_model  # noqa: E402
from kiln.model.bert_config import BertConfig  # noqa: E402
from kiln.model.weights import load_weights  # noqa: E402


def kiln_bert(vocab_size: int, num_labels: int = 0):
    cfg = BertConfig(vocab_size=vocab_size, dim=48, n_layers=2, n_heads=4, max_seq_len=32, num_labels=num_labels)
    return randomise(build_model(cfg)).eval()


def batch(vocab_size: int):
    tokens = torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(tokens)
    mask[1, 10:] = 0
    return tokens, mask


@pytest.mark.parametrize("num_labels", [0, 4])
def test_exported_folder_loads_in_transformers_with_identical_logits(tmp_path, kiln_tokenizer, num_labels):
    model = kiln_bert(kiln_tokenizer.vocab_size, num_labels)
    save_weights(tmp_path / "ckpt", model.cfg, model.state_dict(), {"step": 3})
    shutil.copy(kiln_tokenizer.path, tmp_path / "ckpt" / "tokenizer.json")
    assert main(["export", "hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    auto = transformers.AutoModelForSequenceClassification if num_labels else transformers.AutoModelForMaskedLM
    hf = auto.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == ("BertForSequenceClassification" if num_labels else "BertForMaskedLM")
    tokens, mask = batch(kiln_tokenizer.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(
            hf(input_ids=tokens, attention_mask=mask).logits, model(tokens, mask), rtol=1e-4, atol=1e-4
        )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "bert" and config["pad_token_id"] == kiln_tokenizer.pad_id
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.mask_token == "<|mask|>" and tok.mask_token_id == kiln_tokenizer.token_id("<|mask|>")
    assert tok("def f(x):")["input_ids"] == kiln_tokenizer.encode("def f(x):")


@pytest.mark.parametrize("cls", ["BertForMaskedLM", "BertForSequenceClassification"])
def test_transformers_folder_imports_into_a_kiln_checkpoint(tmp_path, cls):
    config = transformers.BertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=72,
        max_position_embeddings=40, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = randomise(getattr(transformers, cls)(config)).eval()
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    cfg, state, manifest = load_weights(tmp_path / "ckpt")
    assert manifest["model_config"]["arch"] == "bert"
    assert cfg.num_labels == (3 if "Classification" in cls else 0) and cfg.ffn_hidden_size == 72
    model = build_model(cfg).eval()
    model.load_state_dict(state)
    tokens, mask = batch(120)
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens, mask), hf(input_ids=tokens, attention_mask=mask).logits, rtol=1e-4, atol=1e-4
        )


def test_import_refuses_what_kiln_bert_cannot_hold(tmp_path):
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    transformers.BertForPreTraining(config).save_pretrained(tmp_path / "pre")
    with pytest.raises(DataError, match="architectures"):
        import_hf(tmp_path / "pre")
    folder = tmp_path / "pre"
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(DataError, match="no place for: .*seq_relationship"):  # the next-sentence head
        import_hf(folder)
    for key, value in (("hidden_act", "gelu_new"), ("position_embedding_type", "relative_key"), ("is_decoder", True)):
        (folder / "config.json").write_text(json.dumps({**saved, key: value}))
        with pytest.raises(DataError, match=key):
            import_hf(folder)


def test_export_writes_weights_only_without_a_tokenizer(tmp_path):
    model = kiln_bert(64)
    export_hf(model.cfg, model.state_dict(), None, tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    tokens, _ = batch(64)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)
