"""Activation checkpointing keeps fewer activations for backward and leaves loss and gradients unchanged.

The kept bytes are kiln.model.activations.kept_tensor_bytes of one forward: what autograd saves, plus
what the forward's ops created and still hold when it returns (selective checkpointing keeps its ops'
outputs in its own cache, which saved_tensors_hooks does not see). Measured through both places the
`activation_checkpointing` key takes effect: the Trainer's single-process path and `parallelize`,
which the Layout runs on the model (or each pipeline stage) under a mesh.
"""

import dataclasses

import pytest
import torch
from kiln_testing.train import tiny_train_config, token_batch, train_step_capturing_grads

from kiln.errors import ConfigError
from kiln.model import ModelConfig, build_model
from kiln.model.activations import kept_tensor_bytes
from kiln.parallel.config import ParallelConfig
from kiln.parallel.dims import ParallelDims
from kiln.parallel.parallelize import parallelize
from kiln.train.objective import next_token_loss
from kiln.train.trainer import Trainer

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
MODES = ("none", "selective", "full")


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


def _trainer_step(pack, out, mode: str):
    """(bytes one forward keeps, loss and gradients the optimizer sees) of one Trainer step."""
    trainer = Trainer(MODEL, tiny_train_config(activation_checkpointing=mode), pack, out, resume="none")
    kept = kept_tensor_bytes(lambda: next_token_loss(trainer.forward_model, token_batch()))
    stats, grads = train_step_capturing_grads(trainer, [token_batch()])
    return kept, stats["loss"], grads


def _assert_fewer_bytes_same_gradients(results: dict) -> None:
    (plain_bytes, plain_loss, plain_grads) = results["none"]
    (selective_bytes, *_), (full_bytes, *_) = results["selective"], results["full"]
    # Full keeps only block inputs (and what is outside the blocks: embedding, final norm, head, loss);
    # selective keeps in between.
    assert plain_bytes > selective_bytes > full_bytes, (plain_bytes, selective_bytes, full_bytes)
    for mode in ("selective", "full"):
        _, loss, grads = results[mode]
        assert loss == plain_loss, mode
        assert grads.keys() == plain_grads.keys()
        for name, grad in plain_grads.items():
            # The recompute (and selective's cached outputs) are the same computation: on CPU the
            # gradients are bit-identical, well within fp32 tolerance.
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=f"{mode}: {name}")
            assert grad.abs().max() > 0, name


def test_trainer_key_keeps_fewer_activations_and_the_gradients(pack, tmp_path):
    _assert_fewer_bytes_same_gradients({mode: _trainer_step(pack, tmp_path / mode, mode) for mode in MODES})


def _parallelized_step(mode: str):
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(MODEL, vocab_size=64))
    dims = ParallelDims.from_config(ParallelConfig(), world_size=1)
    forward_model = parallelize(
        model,
        dims,
        None,
        ParallelConfig(),
        compute_dtype=torch.float32,
        activation_checkpointing=mode,
        compile_blocks=False,
    )
    kept = kept_tensor_bytes(lambda: next_token_loss(forward_model, token_batch()))
    loss, _ = next_token_loss(forward_model, token_batch())
    loss.backward()
    return kept, loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_parallelize_applies_the_key_for_the_layout():
    _assert_fewer_bytes_same_gradients({mode: _parallelized_step(mode) for mode in MODES})


def test_modes_are_checked():
    for value, spelling in ((True, '"full"'), (False, '"none"')):
        with pytest.raises(ConfigError, match=f"activation_checkpointing: is a mode now: write {spelling}"):
            tiny_train_config(activation_checkpointing=value).validate()
    with pytest.raises(ConfigError, match="activation_checkpointing: must be one of none, selective, full"):
        tiny_train_config(activation_checkpointing="selectve").validate()


def test_recipe_refuses_the_old_booleans(tmp_path):
    from kiln.recipe import load_recipe

    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nactivation_checkpointing = true\n")
    with pytest.raises(ConfigError, match=r'r.toml: train.activation_checkpointing: is a mode now: write "full"'):
        load_recipe(recipe)
    assert load_recipe(recipe, ["train.activation_checkpointing=selective"]).train.activation_checkpointing == (
        "selective"
    )
    with pytest.raises(ConfigError, match='write "none" for false'):
        load_recipe(None, ["train.activation_checkpointing=false"])


def _step_flops(mode: str, cfg: ModelConfig = MODEL) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from kiln.parallel.parallelize import apply_activation_checkpointing

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg, vocab_size=64))
    apply_activation_checkpointing(model, mode)
    with FlopCounterMode(display=False) as counter:
        loss, _ = next_token_loss(model, token_batch())
        loss.backward()
    return counter.get_total_flops()


def test_recompute_factor_counts_what_selective_recomputes():
    # torch's FLOP counter over one forward + backward: selective recomputes each block's output
    # projection wo (2 * dim * dim FLOPs per token), nothing else that has FLOPs.
    from kiln.model import flops_per_token
    from kiln.train.trainer import recompute_factor

    tokens = 4 * 16
    extra = _step_flops("selective") - _step_flops("none")
    assert extra == tokens * MODEL.n_layers * 2 * MODEL.dim * MODEL.n_heads * MODEL.head_dim
    cfg = dataclasses.replace(MODEL, vocab_size=64)
    assert recompute_factor(cfg, 16, "selective") == pytest.approx(1 + extra / (tokens * flops_per_token(cfg, 16)))
    assert recompute_factor(cfg, 16, "none") == 1.0


def test_recompute_factor_counts_the_routed_experts_down_projections_in_moe_layers():
    # In an MoE layer selective also reruns each routed expert's w2, whose output the gates'
    # gradient reads; the shared expert's output is only added, so nothing reruns it.
    from kiln.model import flops_per_token
    from kiln.train.trainer import recompute_factor

    cfg = dataclasses.replace(MODEL, vocab_size=64, moe_every=1, n_experts=4, moe_top_k=2, moe_shared_expert=True)
    tokens = 4 * 16
    extra = _step_flops("selective", cfg) - _step_flops("none", cfg)
    per_layer = 2 * cfg.dim * cfg.n_heads * cfg.head_dim + cfg.moe_top_k * 2 * cfg.dim * cfg.moe_hidden_size
    assert extra == tokens * cfg.n_layers * per_layer
    assert recompute_factor(cfg, 16, "selective") == pytest.approx(1 + extra / (tokens * flops_per_token(cfg, 16)))
