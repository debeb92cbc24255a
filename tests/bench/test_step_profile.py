"""bench/step_profile.py puts a training step's operator time into the right categories."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.model import ModelConfig, build_model
from kiln.train.objective import chunked_next_token_loss
from kiln.train.precision import autocast

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from step_profile import CATEGORIES, OPTIMIZER_SCOPE, format_table, profile_steps, scope_modules  # noqa: E402

VOCAB = 1000  # no other dimension of the model has this size


def _step(chunk: int):
    model = build_model(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=1, n_heads=2, max_seq_len=16))
    optimizer = torch.optim.AdamW(model.parameters())

    def step(x, y):
        with autocast("bf16", "cpu"):
            if chunk:
                loss, _ = chunked_next_token_loss(chunk)(model, (x, y))
            else:
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        with torch.profiler.record_function(OPTIMIZER_SCOPE):
            optimizer.step()
            optimizer.zero_grad()

    scope_modules(model, model.output)
    return step


def test_every_part_of_a_step_lands_in_its_category():
    x = torch.randint(0, VOCAB, (2, 16))
    for chunk in (0, 8):
        ms = profile_steps(_step(chunk), x, x, 1, VOCAB)
        assert set(ms) == set(CATEGORIES)
        for category in CATEGORIES:
            assert ms[category] > 0, (chunk, category)
    assert len(format_table({"a": ms})) == len(CATEGORIES) + 2
