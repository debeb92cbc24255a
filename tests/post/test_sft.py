"""The SFT objective: cross-entropy on assistant tokens only, trailing padding cut without changing it."""

import pytest
import torch

from kiln.model import ModelConfig, build_model
from kiln.post.rows import IGNORE
from kiln.post.sft import sft_loss


def test_sft_loss_counts_only_answer_tokens():
    vocab = 11

    def model(inputs, position_ids=None, document_ids=None):
        return torch.nn.functional.one_hot(inputs % vocab, vocab).float() * 3.0

    inputs = torch.tensor([[1, 2, 3, 4]])
    targets = torch.tensor([[IGNORE, 3, IGNORE, 5]])
    loss, counted = sft_loss(model, (inputs, targets, torch.zeros_like(inputs), torch.zeros_like(inputs)))
    logits = model(inputs)[0]
    expected = torch.nn.functional.cross_entropy(logits[[1, 3]], torch.tensor([3, 5]))
    assert counted == 2 and loss.item() == pytest.approx(expected.item())
    empty, n = sft_loss(model, (inputs, torch.full_like(targets, IGNORE), inputs, inputs))
    assert n == 0 and empty.item() == 0.0


def test_trailing_padding_is_cut_without_changing_the_loss():
    model = build_model(ModelConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, max_seq_len=32))
    inputs = torch.randint(2, 40, (3, 32))
    targets = torch.full((3, 32), IGNORE)
    targets[0, 3:9], targets[1, 5:12], targets[2, 1:4] = 7, 8, 9  # the last target at position 11
    positions = torch.arange(32).expand(3, 32)
    documents = torch.zeros(3, 32, dtype=torch.long)
    loss, n = sft_loss(model, (inputs, targets, positions, documents))
    logits = model(inputs, position_ids=positions, document_ids=documents)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    assert n == 6 + 7 + 3
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
