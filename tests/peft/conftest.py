import pytest
import torch
from kiln_testing.models import randomise

from kiln.model import ModelConfig, build_model

VOCAB = 320


@torch.no_grad()
def _fill_lora(model, std=0.1, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("lora_B") or name.endswith("lora_A") or ".adapter." in name:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


@pytest.fixture
def fill_peft():
    """fill_peft(model) gives LoRA A/B and adapter weights random values: B and the adapters' up
    projection start at zero, which would make every equivalence check pass trivially."""
    return _fill_lora


@pytest.fixture
def tiny_model():
    """tiny_model(**overrides) -> a small random Kiln Transformer in eval mode."""

    def make(**overrides):
        cfg = ModelConfig(
            **{
                **dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, rope_theta=500.0),
                **overrides,
            }
        )
        return randomise(build_model(cfg)).eval()

    return make


@pytest.fixture
def tokens():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
