import math

import pytest
import torch

from kiln.infer.engine import Engine
from kiln.infer.sampling import filter_logits
from kiln.model import ModelConfig, build_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    kept = lambda p: set(torch.isfinite(filter_logits(logits, top_p=p)).nonzero().flatten().tolist())  # noqa: E731
    assert kept(0.5) == {1}
    assert kept(0.7) == {1, 3}
    assert kept(0.81) == {1, 3, 2}
    assert kept(1.0) == {0, 1, 2, 3}
    # top-k and top-p combine: top-k first, then the nucleus of what is left.
    assert set(torch.isfinite(filter_logits(logits, top_k=2, top_p=0.99)).nonzero().flatten().tolist()) == {1, 3}


def test_top_p_restricts_sampled_support():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=2, max_seq_len=16, init_std=0.2)
    model = build_model(cfg).eval()
    prompt = [9, 8, 7]
    with torch.no_grad():
        probs = model(torch.tensor([prompt]))[0, -1].softmax(-1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    allowed = set(order[: int((cumulative < 0.6).sum()) + 1].tolist())
    seen = {out.ids[0] for out in Engine(model).generate([prompt] * 200, 1, temperature=1.0, top_p=0.6, seed=0)}
    assert seen <= allowed
    assert len(allowed) == 1 or len(seen) > 1


def test_temperature_flattens_or_sharpens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    cold = torch.multinomial((logits / 0.05).softmax(-1), 500, replacement=True, generator=generator)
    assert (cold == 0).all()
    assert math.isclose(filter_logits(logits).sum().item(), 3.0)  # no filtering leaves logits unchanged
