"""Fine-tuning a classification head on a BERT encoder: a separable toy task reaches high accuracy,
and the encoder's weights come from the checkpoint."""

import pytest
import torch
from kiln_testing.train import tiny_train_config

from kiln.checkpoint import save_weights
from kiln.errors import ConfigError
from kiln.model import build_model
from kiln.model.bert_config import BertConfig
from kiln.model.config import ModelConfig
from kiln.post.classify import accuracy, finetune_classifier

SEQ = 16


def rows(n: int, seed: int):
    """Class 0 rows hold tokens 10..29, class 1 rows tokens 30..49, after a first token 0 and before
    padding (id 1, masked out) of random length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        label = i % 2
        length = int(torch.randint(4, SEQ + 1, (), generator=g))
        tokens = torch.ones(SEQ, dtype=torch.long)
        tokens[0] = 0
        tokens[1:length] = torch.randint(10 + 20 * label, 30 + 20 * label, (length - 1,), generator=g)
        mask = (torch.arange(SEQ) < length).long()
        out.append((tokens, mask, torch.tensor(label)))
    return out


def test_classifier_fine_tunes_to_high_accuracy(tmp_path):
    cfg = BertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=SEQ, dropout=0.0, attn_dropout=0.0)
    encoder = build_model(cfg)
    save_weights(tmp_path / "mlm", cfg, encoder.state_dict(), {"step": 0})
    train_cfg = tiny_train_config(
        seq_len=SEQ, micro_batch_size=16, global_batch_tokens=SEQ * 16, max_steps=25, lr=3e-3, eval_every=25,
        ckpt_every=25, log_every=25,
    )  # fmt: skip
    val = rows(64, seed=2)
    trainer = finetune_classifier(tmp_path / "mlm", rows(256, seed=1), val, 2, train_cfg, tmp_path / "cls", "cpu")
    torch.testing.assert_close(trainer.model.tok_embeddings.weight, encoder.tok_embeddings.weight)
    torch.testing.assert_close(trainer.model.layers[1].ffn.w2.weight, encoder.layers[1].ffn.w2.weight)
    before = accuracy(trainer.model, val)
    trainer.fit()
    after = accuracy(trainer.model, val)
    assert before < 0.8 and after >= 0.95, (before, after)


def test_fine_tuning_needs_a_bert(tmp_path):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
    save_weights(tmp_path / "gpt", cfg, build_model(cfg).state_dict(), {"step": 0})
    with pytest.raises(ConfigError, match="needs a BERT"):
        finetune_classifier(tmp_path / "gpt", rows(4, 0), rows(4, 1), 2, tiny_train_config(), tmp_path / "o")
