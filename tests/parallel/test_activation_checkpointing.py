"""Activation checkpointing saves fewer activations for backward and leaves the gradients unchanged.

The saved bytes are what autograd packs during the forward (`saved_tensors_hooks`): with
checkpointing, each block's internals are packed by the checkpoint's own inner hooks (and dropped)
instead of reaching the outer hook, so only block inputs, the head and the loss remain. Measured
through both places the `activation_checkpointing` key takes effect: the Trainer's single-process
path and `parallelize`, which the Layout runs on the model (or each pipeline stage) under a mesh.
"""

import dataclasses

import pytest
import torch
from kiln_testing.train import tiny_train_config, token_batch, train_step_capturing_grads

from kiln.model import ModelConfig, build_model
from kiln.parallel.config import ParallelConfig
from kiln.parallel.dims import ParallelDims
from kiln.parallel.parallelize import parallelize
from kiln.train.objective import next_token_loss
from kiln.train.trainer import Trainer

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


class SavedBytes:
    """Sums the bytes of every tensor autograd saves for backward while the context is open."""

    def __init__(self):
        self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        self.total += tensor.numel() * tensor.element_size()
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def _trainer_step(pack, out, checkpointing: bool):
    """(bytes saved by the forward, gradients the optimizer sees) of one Trainer step."""
    trainer = Trainer(MODEL, tiny_train_config(activation_checkpointing=checkpointing), pack, out, resume="none")
    # The whole step runs inside the hooks: a recompute in backward packs into the checkpoint's
    # own hooks, so only what the forward kept reaches this count.
    with SavedBytes() as saved:
        _, grads = train_step_capturing_grads(trainer, [token_batch()])
    return saved.total, grads


def test_trainer_key_saves_fewer_activations_and_keeps_the_gradients(pack, tmp_path):
    plain_bytes, plain_grads = _trainer_step(pack, tmp_path / "plain", checkpointing=False)
    checkpointed_bytes, checkpointed_grads = _trainer_step(pack, tmp_path / "ac", checkpointing=True)
    # Measured 664 kB without and 94 kB with (2 blocks, 4 x 16 tokens, dim 32): the rest is the
    # block inputs, the final norm, the head's logits and the loss.
    assert checkpointed_bytes < plain_bytes / 4, (checkpointed_bytes, plain_bytes)
    assert plain_grads.keys() == checkpointed_grads.keys()
    for name, grad in plain_grads.items():
        # The recompute is the same computation: gradients are bit-identical on CPU.
        assert torch.equal(checkpointed_grads[name], grad), name
        assert grad.abs().max() > 0, name


def _parallelized_step(checkpointing: bool):
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(MODEL, vocab_size=64))
    dims = ParallelDims.from_config(ParallelConfig(), world_size=1)
    forward_model = parallelize(
        model,
        dims,
        None,
        ParallelConfig(),
        compute_dtype=torch.float32,
        activation_checkpointing=checkpointing,
        compile_blocks=False,
    )
    with SavedBytes() as saved:
        loss, _ = next_token_loss(forward_model, token_batch())
    loss.backward()
    return saved.total, {n: p.grad for n, p in model.named_parameters()}


def test_parallelize_applies_the_key_for_the_layout():
    plain_bytes, plain_grads = _parallelized_step(checkpointing=False)
    checkpointed_bytes, checkpointed_grads = _parallelized_step(checkpointing=True)
    assert checkpointed_bytes < plain_bytes / 4, (checkpointed_bytes, plain_bytes)
    for name, grad in plain_grads.items():
        assert torch.equal(checkpointed_grads[name], grad), name
