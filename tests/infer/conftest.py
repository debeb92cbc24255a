import pytest
import torch

from kiln.model import ModelConfig, build_model


@pytest.fixture(scope="module")
def byte_model():
    """A random 2-layer model over the 300 ids of the byte_tokenizer range, peaked enough
    (init_std 0.2) that sampling and greedy decoding differ."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=2, max_seq_len=16, init_std=0.2)
    return build_model(cfg).eval()
