"""A small random transformers LlamaForCausalLM with a given RoPE, for the RoPE scaling tests."""

from __future__ import annotations

import torch

from kiln_testing.models import randomise


def hf_llama(rope: dict, max_position_embeddings: int, vocab_size: int = 320, hidden_size: int = 64):
    """rope: transformers' rope_parameters without rope_theta (1000 here)."""
    import transformers  # the callers skip their module when it is missing

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={**rope, "rope_theta": 1000.0},
    )
    torch.manual_seed(0)
    return randomise(transformers.LlamaForCausalLM(config)).eval()
