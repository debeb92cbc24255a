"""Expert parallelism on 2 gloo processes against the single-process model on the union of their batches."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from kiln.errors import ConfigError
from kiln.model import ModelConfig, Transformer, build_model
from kiln.model.moe import MoEFeedForward, moe_aux_loss, moe_stats
from kiln.parallel.expert import apply_expert_parallel

WORLD = 2
PER_RANK = 2  # sequences in each rank's own batch


def moe_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=61,
        dim=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=16,
        moe_every=1,
        n_experts=4,
        moe_top_k=2,
        moe_hidden=48,
        moe_shared_expert=True,
    )
    return ModelConfig(**{**base, **overrides})


def lm_loss(model, inputs, targets):
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + moe_aux_loss(model), logits


def check_matches_single_process(rank: int, mesh, overrides: dict) -> None:
    cfg = moe_config(**overrides)
    torch.manual_seed(0)
    reference = build_model(cfg)
    model = apply_expert_parallel(copy.deepcopy(reference), mesh)
    tokens = torch.randint(0, cfg.vocab_size, (WORLD * PER_RANK, 13), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    ref_loss, ref_logits = lm_loss(reference, inputs, targets)
    ref_loss.backward()
    loss, logits = lm_loss(model, inputs[mine], targets[mine])
    loss.backward()

    torch.testing.assert_close(logits, ref_logits[mine], rtol=1e-5, atol=1e-5)
    # Each rank's routing loss is scaled so that the mean over ranks is the union's.
    aux = moe_aux_loss(model).detach().clone()
    dist.all_reduce(aux)
    torch.testing.assert_close(aux / WORLD, moe_aux_loss(reference).detach(), rtol=1e-5, atol=1e-6)
    stats, ref_stats = moe_stats(model), moe_stats(reference)
    assert stats["dropped_frac"] == ref_stats["dropped_frac"]
    assert stats["load_max"] == pytest.approx(ref_stats["load_max"])
    if overrides.get("moe_capacity_factor"):
        assert ref_stats["dropped_frac"] > 0  # the case must exercise drops decided across ranks

    ref_params = dict(reference.named_parameters())
    sharded = 0
    for name, param in model.named_parameters():
        grad = param.grad
        if isinstance(grad, DTensor):
            sharded += 1
            assert isinstance(param, DTensor) and param.to_local().shape[0] == cfg.n_experts // WORLD
            grad = grad.full_tensor()  # already the mean over ranks (see kiln/parallel/expert.py)
        else:
            grad = grad.clone()  # replicated weight: the data-parallel average a DDP would apply
            dist.all_reduce(grad)
            grad /= WORLD
        torch.testing.assert_close(grad, ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert sharded == 3 * sum(cfg.is_moe_layer(layer) for layer in range(cfg.n_layers))  # w1, w3, w2

    # bf16 autocast: the tokens and results cross the all-to-all in mixed dtypes and still agree.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(model(inputs[mine]), reference(inputs)[mine], rtol=2e-2, atol=2e-2)


def check_meta_init_matches_single_process(mesh) -> None:
    cfg = moe_config()
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_expert_parallel(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    torch.manual_seed(0)
    reference = build_model(cfg)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        torch.testing.assert_close(full, ref_params[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def check_composes_with_fsdp2(rank: int) -> None:
    """EP over the ep dimension, FSDP2 over the data-parallel ranks: experts get their own FSDP unit on
    the ranks that hold the same experts (here 1), blocks and root shard over all of dp_shard. The
    expert gradients need no extra divide factor because the all-to-all already averages them."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    mesh[("dp_shard_mod_ep", "ep")]._flatten("dp_shard")
    cfg = moe_config()
    torch.manual_seed(0)
    reference = build_model(cfg)
    model = apply_expert_parallel(copy.deepcopy(reference), mesh["ep"])
    for block in model.layers:
        if isinstance(block.ffn, MoEFeedForward):
            fully_shard(block.ffn.experts, mesh=mesh["dp_shard_mod_ep"])
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    tokens = torch.randint(0, cfg.vocab_size, (WORLD * PER_RANK, 13), generator=torch.Generator().manual_seed(2))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    ref_loss, ref_logits = lm_loss(reference, inputs, targets)
    ref_loss.backward()
    loss, logits = lm_loss(model, inputs[mine], targets[mine])
    loss.backward()
    torch.testing.assert_close(logits, ref_logits[mine], rtol=1e-5, atol=1e-5)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(
            param.grad.full_tensor(), ref_params[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}"
        )


def worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        check_matches_single_process(rank, mesh, {})
        check_matches_single_process(
            rank, mesh, {"moe_capacity_factor": 1.0, "moe_norm_topk": False, "moe_shared_expert": False, "moe_every": 2}
        )
        check_meta_init_matches_single_process(mesh)
        check_composes_with_fsdp2(rank)
        # A process group works as well as a mesh.
        model = apply_expert_parallel(build_model(moe_config(n_layers=1)), dist.group.WORLD)
        assert isinstance(model.layers[0].ffn.experts.w1, DTensor)
        with pytest.raises(ConfigError, match="must divide model.n_experts=3"):
            apply_expert_parallel(build_model(moe_config(n_experts=3)), mesh)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_matches_single_process(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=True)


def test_apply_expert_parallel_rejects_bad_layouts(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="needs MoE layers"):
            apply_expert_parallel(build_model(moe_config(moe_every=0)), dist.group.WORLD)
    finally:
        dist.destroy_process_group()
