"""The planner's account of each optimizer (kiln.parallel.optimizer_state): the parameter tensors it
counts are the model's, its Muon split is the trainer's, and `kiln plan` prices memory and step time
with the optimizer a recipe or --optimizer names (it used to assume AdamW whatever was set). What the
optimizers really hold on a trainer step is checked in test_plan_memory_check.py."""

import argparse
import collections
import json

import pytest
import torch

from kiln.errors import ConfigError
from kiln.model.config import ModelConfig, preset
from kiln.model.transformer import Transformer
from kiln.parallel.hardware import ClusterConfig
from kiln.parallel.optimizer_state import OptimizerState, optimizer_state, param_shapes
from kiln.parallel.plan import Layout, Workload, layout_problems, memory, total_params
from kiln.parallel.plan_cli import add_plan_parser
from kiln.parallel.plan_time import estimate
from kiln.pipeline_verbs import run as run_plan
from kiln.train.muon import muon_split

BASE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=100, max_seq_len=32)
SHAPES = {
    "swiglu": {},
    "gpt2-like": dict(ffn="gelu", norm="layernorm", pos="learned", qkv_bias=True, tie_embeddings=True),
    "moe": dict(qk_norm=True, moe_every=2, n_experts=4, moe_top_k=2, moe_hidden=48, moe_shared_expert=True),
}


@pytest.mark.parametrize("name", SHAPES)
def test_param_shapes_are_the_models_and_the_muon_split_the_trainers(name):
    cfg = ModelConfig(**BASE, **SHAPES[name])
    with torch.device("meta"):
        model = Transformer(cfg)
    _, muon_ids = muon_split(model)
    theirs = collections.Counter((tuple(p.shape), id(p) in muon_ids) for p in model.parameters())
    ours = collections.Counter()
    for p, count in param_shapes(cfg):
        ours[(p.shape, p.block_matrix)] += count
    assert ours == theirs
    assert sum(count * p.numel for p, count in param_shapes(cfg)) == total_params(cfg)


def test_state_per_parameter():
    cfg = ModelConfig(**BASE, **SHAPES["moe"])
    assert optimizer_state(cfg, "adamw").bytes_per_param == 8
    assert optimizer_state(cfg, "lion").bytes_per_param == 4
    muon = optimizer_state(cfg, "muon")
    assert 4 < muon.bytes_per_param < 8 and muon.expert_bytes_per_param == 8  # 3-D expert banks take AdamW
    ada = optimizer_state(cfg, "adafactor")
    # A [4, 48, 64] expert bank keeps 4 x (48 + 64) values.
    assert ada.expert_bytes_per_param == pytest.approx(4 * 4 * (48 + 64) / (4 * 48 * 64))
    with pytest.raises(ConfigError, match="optimizer"):
        optimizer_state(cfg, "sgd")


def test_the_planner_models_every_optimizer_the_trainer_builds():
    """kiln.train.config.OPTIMIZERS lives a layer above the planner, so the planner keeps its own
    list; a trainer optimizer without a planner model fails here rather than in `kiln plan`."""
    from kiln.parallel.optimizer_state import OPTIMIZERS as PLANNED
    from kiln.train.config import OPTIMIZERS as TRAINED

    assert PLANNED == TRAINED


def test_newton_schulz_flops_worked_number():
    # A 3 x 5 matrix (and its transpose), 5 iterations: 5 x (4 * 3^2 * 5 + 2 * 3^3) = 1170 each.
    state = OptimizerState(0, 1, muon_shapes=(((3, 5), 1), ((5, 3), 1)))
    assert state.newton_schulz_flops(5) == 2 * 1170
    assert state.newton_schulz_flops(1) == 2 * 234


def _8b():
    return ModelConfig(**{**preset("8b").__dict__, "vocab_size": 128256})


def test_cluster_memory_and_time_follow_the_optimizer():
    cfg, cluster = _8b(), ClusterConfig(gpu="h100", gpus_per_node=8, n_nodes=1)
    ddp = Layout(dp_replicate=8, ac="full")
    work = {o: Workload(8192, 8 * 8192, o) for o in ("adamw", "lion", "adafactor", "muon")}
    psi = total_params(cfg)
    mem = {o: memory(cfg, ddp, w) for o, w in work.items()}
    # Unsharded: the fp32 master copy (4 bytes) plus the optimizer's own state, for every parameter.
    assert mem["adamw"].optimizer == pytest.approx(12 * psi)
    assert mem["lion"].optimizer == pytest.approx(8 * psi)
    assert mem["muon"].optimizer == pytest.approx(4 * psi + optimizer_state(cfg, "muon").state_bytes)
    assert mem["adafactor"].optimizer < 4.01 * psi
    times = {o: estimate(cfg, ddp, cluster, w).optimizer_time for o, w in work.items()}
    assert times["adamw"] == pytest.approx(32 * psi / cluster.spec.hbm_bw)
    assert times["lion"] == pytest.approx(24 * psi / cluster.spec.hbm_bw)
    muon = optimizer_state(cfg, "muon")
    newton_schulz = muon.newton_schulz_flops(5) / (cluster.peak_flops * cluster.matmul_efficiency)
    assert newton_schulz > 0.5  # 682 TFLOP a step for the 8B model, on every replica
    expected = (16 * psi + 2 * muon.state_bytes) / cluster.spec.hbm_bw + newton_schulz
    assert times["muon"] == pytest.approx(expected)
    # More iterations, more time.
    longer = estimate(cfg, ddp, cluster, Workload(8192, 8 * 8192, "muon", muon_ns_steps=10)).optimizer_time
    assert longer == pytest.approx(expected + newton_schulz)


def test_sharded_muon_spreads_newton_schulz_and_pays_the_gathers():
    """Under FSDP the matrices go in rounds of 8, two all-to-alls a round (kiln.train.muon's
    orthogonalised_row_shards): a rank does 1/8 of the iterations and puts 7/8 of its own shards on
    the wire twice, far less than gathering every whole matrix to every rank."""
    cfg, cluster = _8b(), ClusterConfig(gpu="h100", gpus_per_node=8, n_nodes=1)
    work = Workload(8192, 8 * 8192, "muon")
    fsdp, ddp = Layout(dp_shard=8, zero=3, ac="full"), Layout(dp_replicate=8, ac="full")
    assert not layout_problems(cfg, fsdp, cluster, work)
    state = optimizer_state(cfg, "muon")
    newton_schulz = state.newton_schulz_flops(5) / (cluster.peak_flops * cluster.matmul_efficiency)
    sharded = estimate(cfg, fsdp, cluster, work)
    memory_bound = estimate(cfg, fsdp, cluster, Workload(8192, 8 * 8192, "muon", muon_ns_steps=1)).optimizer_time
    assert sharded.optimizer_time - memory_bound == pytest.approx(4 / 5 * newton_schulz / 8)
    gathers = sharded.optimizer_time - newton_schulz / 8
    matrices = 4 * state.muon_params
    assert 2 * 7 / 8 * matrices / 8 / cluster.intra < gathers < 2 * 7 / 8 * matrices / cluster.intra
    assert estimate(cfg, ddp, cluster, work).optimizer_time > sharded.optimizer_time  # every rank does all
    # The largest matrix (a 14336 x 4096 FFN weight) gathered whole, and its orthogonalised copy.
    adamw = memory(cfg, fsdp, Workload(8192, 8 * 8192))
    assert sharded.memory.buffers - adamw.buffers == 2 * 4 * 14336 * 4096
    # A tensor-parallel and FSDP mesh: owners on its diagonal, min(2, 4) of them.
    both = Layout(dp_shard=2, tp=4, zero=3, ac="full")
    one_step = estimate(cfg, both, cluster, Workload(8192, 8 * 8192, "muon", muon_ns_steps=1)).optimizer_time
    assert estimate(cfg, both, cluster, work).optimizer_time - one_step == pytest.approx(4 / 5 * newton_schulz / 2)


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="verb"))
    return parser.parse_args(["plan", *argv])


def _plan_json(capsys, *argv) -> dict:
    assert run_plan(_args(*argv, "--gpus-per-node", "2", "--json")) == 0
    return json.loads(capsys.readouterr().out)


def test_kiln_plan_reads_the_recipes_optimizer_and_the_flag(capsys):
    shipped = _plan_json(capsys, "recipes/tiny.toml")  # pretrains with Muon
    not_muon = "train.muon_adjust_lr=original"
    adamw = _plan_json(capsys, "recipes/tiny.toml", "train.optimizer=adamw", not_muon)
    lion = _plan_json(capsys, "recipes/tiny.toml", "train.optimizer=lion", "train.optimizer_impl=foreach", not_muon)
    assert (shipped["optimizer"], adamw["optimizer"], lion["optimizer"]) == ("muon", "adamw", "lion")
    best = {d["optimizer"]: d["ranked"][0] for d in (adamw, lion)}
    assert best["lion"]["memory_gb"]["optimizer"] < best["adamw"]["memory_gb"]["optimizer"]
    assert lion["recipe_tables"]["train"]["optimizer"] == "lion" and "optimizer" not in adamw["recipe_tables"]["train"]
    assert shipped["recipe_tables"]["train"]["optimizer"] == "muon"
    # The flag overrides the recipe.
    muon = _plan_json(
        capsys,
        "recipes/tiny.toml",
        "train.optimizer=lion",
        "train.optimizer_impl=foreach",
        not_muon,
        "--optimizer",
        "muon",
    )
    assert muon["optimizer"] == "muon" and muon["recipe_tables"]["train"]["optimizer"] == "muon"
    with pytest.raises(ConfigError, match="--optimizer"):
        run_plan(_args("--preset", "tiny", "--optimizer", "sgd"))


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_kiln_plan_refuses_a_precision_it_does_not_model(precision):
    """The planner's activations, autocast copies and peaks are 16-bit: a recipe training in fp32 or
    fp8 is refused by key rather than planned as bf16."""
    with pytest.raises(ConfigError, match="train.precision"):
        run_plan(_args("recipes/tiny.toml", f"train.precision={precision}"))
