"""The memory and reduction options of [parallel]: each either changes what runs or is refused,
naming its key, before anything is built (docs/parallel.md, "Which options apply where").

FSDP2 on one rank with CPU offload is what `parallel.offload` does in one process on a GPU. Without
a GPU these tests run the same wrapping on CPU tensors over a one-rank gloo group: the policy is
applied and training matches the plain model; only the device the blocks are copied to differs.
"""

import pytest
import torch
import torch.distributed as dist
from kiln_testing.train import tiny_train_config
from torch.distributed.tensor import DTensor

from kiln.cli import main
from kiln.errors import ConfigError
from kiln.model import ModelConfig, build_model
from kiln.model.weights import load_weights
from kiln.parallel.config import ParallelConfig
from kiln.parallel.dims import ParallelDims, init_single_process_group
from kiln.parallel.launch import LaunchConfig, check_layout
from kiln.parallel.layout import Layout
from kiln.parallel.parallelize import parallelize
from kiln.parallel.plan import Layout as PlanLayout
from kiln.recipe import load_recipe
from kiln.train.trainer import Trainer

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, vocab_size=64)

# (the [parallel] table, resolved dp_shard, device) -> the refused key, or None where it is used.
CASES = [
    ({"offload": True}, 1, "cuda", None),  # one GPU: FSDP2 on one rank keeps the weights on the CPU
    ({"offload": True}, 1, "cpu", "offload"),  # on the CPU the weights are on the CPU already
    ({"offload": True, "dp_shard": 2}, 2, "cpu", "offload"),
    ({"offload": True, "dp_shard": 2}, 2, "cuda", None),
    ({"offload": True, "dp_replicate": 2, "dp_shard": 1}, 1, "cuda", "offload"),  # DDP shards nothing
    ({"offload": True, "tp": 2, "dp_shard": 1}, 1, "cuda", "offload"),
    ({"offload": True, "reshard_after_forward": False}, 1, "cuda", None),
    ({"reshard_after_forward": False}, 1, "cuda", "reshard_after_forward"),
    ({"reshard_after_forward": False}, 1, "cpu", "reshard_after_forward"),
    ({"reshard_after_forward": False, "dp_replicate": 2, "dp_shard": 1}, 1, "cpu", "reshard_after_forward"),
    ({"reshard_after_forward": False, "pp": 2, "dp_shard": 1}, 1, "cpu", "reshard_after_forward"),
    ({"reshard_after_forward": False, "dp_shard": 2}, 2, "cpu", None),
    ({"reshard_after_forward": False, "cp": 2, "dp_shard": 1}, 1, "cpu", None),  # FSDP over the cp ranks
    ({"reduce_dtype": "bf16"}, 1, "cuda", "reduce_dtype"),  # one process reduces nothing
    ({"reduce_dtype": "bf16", "offload": True}, 1, "cuda", "reduce_dtype"),
    ({"reduce_dtype": "bf16", "dp_replicate": 2, "dp_shard": 1}, 1, "cpu", "reduce_dtype"),  # DDP
    ({"reduce_dtype": "bf16", "tp": 2, "dp_shard": 1}, 1, "cpu", "reduce_dtype"),
    ({"reduce_dtype": "bf16", "dp_shard": 2}, 2, "cpu", None),
    ({"reduce_dtype": "bf16", "dp_replicate": 2, "dp_shard": 2}, 2, "cpu", None),  # HSDP
    ({"dp_replicate": 2, "tp": 2, "dp_shard": 1}, 1, "cpu", "dp_replicate"),  # nothing averages the replicas
    ({"dp_replicate": 2, "pp": 2, "dp_shard": 1}, 1, "cpu", "dp_replicate"),
    ({"dp_replicate": 2, "tp": 2, "dp_shard": 2}, 2, "cpu", None),
    ({"async_checkpoint": True}, 1, "cpu", None),
    ({"async_checkpoint": True, "dp_replicate": 2, "dp_shard": 1}, 1, "cpu", None),
]


@pytest.mark.parametrize(("table", "dp_shard", "device", "refused"), CASES)
def test_each_option_is_used_by_the_layout_or_refused(table, dp_shard, device, refused):
    cfg = ParallelConfig(**table)
    if refused is None:
        cfg.check_options(dp_shard, device)
        return
    with pytest.raises(ConfigError) as err:
        cfg.check_options(dp_shard, device)
    assert err.value.key == refused


def test_a_recipe_with_every_degree_given_is_refused_when_it_loads(tmp_path):
    # dp_shard given: the world size is known, so the recipe loader refuses before any stage runs.
    with pytest.raises(ConfigError, match=r"parallel\.reshard_after_forward: applies to FSDP2.*one process"):
        load_recipe(None, ["parallel.dp_shard=1", "parallel.reshard_after_forward=false"])
    with pytest.raises(ConfigError, match=r"parallel\.reduce_dtype: .*the layout dp_replicate=2 has none"):
        load_recipe(None, ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.reduce_dtype=bf16"])
    # dp_shard = -1 leaves the world size to the launch: checked when the layout is known.
    assert load_recipe(None, ["parallel.reduce_dtype=bf16"]).parallel.reduce_dtype == "bf16"


@pytest.mark.parametrize(
    ("table", "key"),
    [({"offload": True}, "offload"), ({"reduce_dtype": "bf16"}, "reduce_dtype")],
)
def test_one_process_on_the_cpu_refuses_before_building_anything(table, key):
    with pytest.raises(ConfigError) as err:
        Layout(ParallelConfig(**table), MODEL, torch.device("cpu"))
    assert err.value.key == f"parallel.{key}"
    assert not dist.is_initialized()


@pytest.mark.parametrize("verb", ["pretrain", "run"])
def test_kiln_refuses_offload_on_the_cpu_in_one_line_before_any_stage_runs(verb, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the Trainer would pick the cpu
    argv = [verb, "recipes/tiny.toml", f"run.out_dir={tmp_path}", "parallel.offload=true"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kiln: error: parallel.offload: ") and "on device cpu" in err
    assert len(err.splitlines()) == 1
    assert not list(tmp_path.iterdir())  # not even the corpus stage ran


def test_launch_refuses_an_option_the_launched_layout_would_not_use(tmp_path):
    recipe = str(tmp_path / "r.toml")
    with pytest.raises(ConfigError, match=r"r\.toml: parallel\.offload: is FSDP2's CPU offload"):
        check_layout(ParallelConfig(dp_replicate=4, offload=True), LaunchConfig(nproc_per_node=4), recipe)
    check_layout(ParallelConfig(offload=True), LaunchConfig(nproc_per_node=4, device="cuda"), recipe)


def test_plan_prints_layouts_that_load():
    for zero in (0, 1, 2, 3):
        shard = 1 if zero == 0 else 8
        ParallelConfig.validate(PlanLayout(dp_replicate=8 // shard, dp_shard=shard, zero=zero).to_parallel_config(0))


# ---- FSDP2 on one rank ----------------------------------------------------------------------------


@pytest.fixture
def one_rank_group():
    init_single_process_group("cpu")
    yield
    dist.destroy_process_group()


def _one_rank_fsdp(cfg: ParallelConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(MODEL)
    dims = ParallelDims.from_config(cfg, 1)
    parallelize(
        model,
        dims,
        dims.build_mesh("cpu"),
        cfg,
        compute_dtype=torch.float32,
        activation_checkpointing="none",
        compile_blocks=False,
    )
    return model


def _param_groups(model):
    # FSDP2 keeps its policy on each wrapped module's parameter group (no public accessor).
    return [m._get_fsdp_state()._fsdp_param_group for m in (*model.layers, model)]


def _steps(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for inputs, targets in batches:
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


@pytest.mark.parametrize("reshard", [True, False])
def test_offload_wraps_every_block_with_the_cpu_offload_policy_and_trains_like_the_plain_model(one_rank_group, reshard):
    cfg = ParallelConfig(offload=True, reshard_after_forward=reshard)
    model = _one_rank_fsdp(cfg)
    torch.manual_seed(0)
    plain = build_model(MODEL)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    groups = _param_groups(model)
    assert all(fp.offload_to_cpu and not fp.pin_memory for g in groups for fp in g.fsdp_params)
    batches = [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(3)]
    losses, opt = _steps(model, batches)
    assert losses == pytest.approx(_steps(plain, batches)[0], rel=1e-6)
    # The optimizer state sits beside the sharded parameters, where the policy put them.
    assert all(s["exp_avg"].device.type == "cpu" and isinstance(s["exp_avg"], DTensor) for s in opt.state.values())


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_decides_whether_a_block_stays_gathered_until_backward(one_rank_group, reshard):
    model = _one_rank_fsdp(ParallelConfig(offload=True, reshard_after_forward=reshard))
    out = model(torch.randint(0, 64, (2, 16)))
    # Resharded, the first block holds its DTensor shards again; kept, its gathered plain tensors.
    assert isinstance(model.layers[0].attn.wqkv.weight, DTensor) is reshard
    out.float().mean().backward()


def test_reduce_dtype_bf16_reduces_gradients_in_bf16(one_rank_group):
    # Not accepted in one process (nothing to reduce); the wrapping is the dp_shard > 1 one.
    grads = {}
    for reduce_dtype in ("fp32", "bf16"):
        model = _one_rank_fsdp(ParallelConfig(offload=True, reduce_dtype=reduce_dtype))
        model(torch.randint(0, 64, (2, 16))).float().logsumexp(-1).mean().backward()
        grads[reduce_dtype] = torch.cat([p.grad.to_local().flatten() for p in model.parameters()])
    for grad in grads.values():
        assert grad.dtype == torch.float32
    assert torch.equal(grads["bf16"], grads["bf16"].bfloat16().float())
    assert not torch.equal(grads["fp32"], grads["fp32"].bfloat16().float())


def test_trainer_with_one_rank_fsdp_offload_matches_the_plain_run(tiny_pack_factory, tmp_path, monkeypatch):
    """The Trainer's own path for offload on one GPU (a one-rank group it starts itself, a one-rank
    mesh, FSDP2, sharded checkpoints), run on the CPU by lifting only the device check."""
    pack = tiny_pack_factory(tmp_path / "pack")
    train = tiny_train_config(max_steps=3, eval_every=3, ckpt_every=3, log_every=1, precision="fp32")
    plain = Trainer(MODEL, train, pack, tmp_path / "plain", resume="none")
    plain_summary = plain.fit()
    check = ParallelConfig.check_options
    monkeypatch.setattr(
        ParallelConfig, "check_options", lambda self, dp_shard, device_type: check(self, dp_shard, None)
    )
    try:
        trainer = Trainer(
            MODEL, train, pack, tmp_path / "offload", resume="none", parallel=ParallelConfig(offload=True)
        )
        assert trainer.layout.mesh is not None and trainer.layout.sharded
        summary = trainer.fit()
    finally:
        dist.destroy_process_group()
    assert summary["final_val_loss"] == pytest.approx(plain_summary["final_val_loss"], rel=1e-5)
    folder = tmp_path / "offload" / "checkpoints" / "step-00000003"
    assert (folder / "sharded" / ".metadata").is_file()
    weights, expected = load_weights(folder)[1], load_weights(tmp_path / "plain" / "checkpoints")[1]
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offload_on_one_gpu_keeps_parameters_and_optimizer_state_on_the_cpu(tiny_pack_factory, tmp_path):
    pack = tiny_pack_factory(tmp_path / "pack")
    train = tiny_train_config(max_steps=2, eval_every=2, ckpt_every=2, precision="fp32")
    try:
        trainer = Trainer(
            MODEL, train, pack, tmp_path / "run", resume="none", device="cuda", parallel=ParallelConfig(offload=True)
        )
        trainer.fit()
        assert {p.device.type for p in trainer.model.parameters()} == {"cpu"}
        state = trainer.optimizer.state.values()
        assert state and all(s["exp_avg"].device.type == "cpu" for s in state)
    finally:
        dist.destroy_process_group()
