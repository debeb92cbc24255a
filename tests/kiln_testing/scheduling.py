"""What the scheduler tests share: a tiny random model for the scheduler to run, and a request's
events read back from its handle."""

from __future__ import annotations

import torch

from kiln.model import ModelConfig, build_model
from kiln.serve.requests import PromptScores


def scheduler_model(max_seq_len: int) -> torch.nn.Module:
    """The same random weights (seed 0) at any context length: vocab 300, dim 32, 2 layers, GQA 4/2."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=max_seq_len, init_std=0.2
    )
    return build_model(cfg).eval()


def collect(handle) -> tuple[PromptScores | None, list]:
    """(the prompt scores or None, the token events) of one request."""
    scores, events = None, []
    for event in handle:
        if isinstance(event, PromptScores):
            scores = event
        else:
            events.append(event)
    return scores, events
