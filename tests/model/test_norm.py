"""kiln.model.norm.RMSNorm without a graph to record (generation, evaluation) computes exactly what
it computes when training."""

import pytest
import torch

from kiln.model.norm import RMSNorm
from kiln.train.precision import autocast


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("no_graph", [torch.no_grad, torch.inference_mode])
def test_norm_without_a_graph_equals_the_training_forward_bit_for_bit(precision, input_dtype, no_graph):
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 48).to(input_dtype)
    with autocast(precision):
        trained = norm(x)  # the weight requires grad: the autograd Function runs
        with no_graph():
            plain = norm(x)
    assert trained.grad_fn is not None and plain.grad_fn is None
    assert plain.dtype == trained.dtype
    torch.testing.assert_close(plain, trained, rtol=0, atol=0)


def test_a_frozen_norm_on_an_input_that_needs_grad_still_backpropagates():
    norm = RMSNorm(16).requires_grad_(False)
    x = torch.randn(2, 16, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
