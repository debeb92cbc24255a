"""The Trainer optimises and logs an MoE model's load-balance and z-losses with the cross-entropy.

The reference is written out here: cross-entropy plus, for every MoE layer, the weighted aux and
z-loss that layer computed in the same forward. With both weights 0 the loss is the cross-entropy
alone, and the router's gradient changes with them.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from kiln_testing.train import tiny_train_config, token_batch, train_step_capturing_grads

from kiln.model import ModelConfig, build_model
from kiln.model.moe import MoEFeedForward
from kiln.train.trainer import Trainer

MOE = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, moe_every=1, n_experts=4, moe_top_k=2)


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


def _trainer_step(pack, out, model_cfg):
    """(logged loss, gradients the optimizer saw, weights before the step, trainer)."""
    # grad_clip 0: the optimizer sees the raw gradients, comparable with the reference's.
    trainer = Trainer(model_cfg, tiny_train_config(grad_clip=0.0), pack, out, resume="none")
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stats, grads = train_step_capturing_grads(trainer, [token_batch()])
    return float(stats["loss"]), grads, start, trainer


def _reference(trainer, start):
    """(cross-entropy, cross-entropy + weighted aux and z-losses, gradients of the latter)."""
    model = build_model(trainer.model_cfg)
    model.load_state_dict(start)
    inputs, targets = token_batch()
    cross_entropy = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    assert len(layers) == 2
    total = cross_entropy + sum(m.aux_loss_weight * m.aux_loss + m.z_loss_weight * m.z_loss for m in layers)
    total.backward()
    return cross_entropy.item(), total.item(), {n: p.grad for n, p in model.named_parameters()}


ROUTERS = ("layers.0.ffn.router.weight", "layers.1.ffn.router.weight")


def test_trainer_step_includes_the_aux_losses(pack, tmp_path):
    loss, grads, start, trainer = _trainer_step(pack, tmp_path / "aux", MOE)
    cross_entropy, expected, expected_grads = _reference(trainer, start)
    assert loss == pytest.approx(expected, abs=1e-6)
    # Measured 0.0239: two layers of 0.01 x (balance loss near 1) + 0.001 x (z-loss near (ln 4)^2).
    assert expected - cross_entropy > 0.02
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-8, msg=name)

    off = dataclasses.replace(MOE, moe_aux_loss_weight=0.0, moe_z_loss_weight=0.0)
    plain_loss, plain_grads, plain_start, _ = _trainer_step(pack, tmp_path / "plain", off)
    assert all(torch.equal(start[n], plain_start[n]) for n in start)  # the same init
    assert plain_loss == pytest.approx(cross_entropy, abs=1e-6)
    for router in ROUTERS:
        # The balance and z-losses pull on the router beyond what the cross-entropy does (measured
        # 2.9e-4 and 7.5e-4, as large as the routers' whole gradients).
        assert (grads[router] - plain_grads[router]).abs().max() > 1e-4, router
