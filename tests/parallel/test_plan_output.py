"""What `kiln plan` prints for a person to act on: [parallel]/[train] tables that load as a recipe and
launch, memory terms that add up to the total, communication that is never shown as free while a
collective runs, and pruned layouts counted once per reason."""

import argparse
import contextlib
import functools
import io
import re

import pytest

from kiln.cli import build_parser
from kiln.config import tomllib  # the standard library's, or tomli before Python 3.11
from kiln.parallel.hardware import GB, NCCL_BASE_LATENCY, NCCL_STEP_LATENCY, ClusterConfig
from kiln.parallel.plan import (
    KILN,
    Layout,
    Workload,
    candidates,
    total_params,
)
from kiln.parallel.plan_cli import add_plan_parser, model_and_workload, parse_layout, pruned_lines, run_plan
from kiln.parallel.plan_time import (
    estimate,
    plan,
)
from kiln.pipeline_verbs import run
from kiln.recipe import load_recipe

# (plan flags, the recipe's [model] table, nodes x GPUs per node for the launch)
CASES = {
    "8b-hsdp": (["--preset", "8b", "--nodes", "4"], 'preset = "8b"\nvocab_size = 128256', (4, 8)),
    "8b-pipeline": (
        ["--preset", "8b", "--nodes", "4", "--layout", "pp=4,zero=1"],
        'preset = "8b"\nvocab_size = 128256',
        (4, 8),
    ),
    "8b-tp": (["--preset", "8b", "--layout", "tp=4,ac=full"], 'preset = "8b"\nvocab_size = 128256', (1, 8)),
    "tiny": (["--preset", "tiny", "--gpus-per-node", "2", "--seq-len", "256"], 'preset = "tiny"', (1, 2)),
    # Kiln's op-level selective checkpointing has a key now: the table says "selective".
    "tiny-selective": (
        ["--preset", "tiny", "--gpus-per-node", "2", "--seq-len", "256", "--layout", "ac=selective"],
        'preset = "tiny"',
        (1, 2),
    ),
}


def _args(argv):
    parser = argparse.ArgumentParser()
    add_plan_parser(parser.add_subparsers(dest="verb"))
    return parser.parse_args(["plan", *argv])


@functools.cache
def _output(case: str) -> str:
    """What `kiln plan` prints for a case (planned once per test session: an 8B search takes seconds)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert run_plan(_args(CASES[case][0])) == 0
    return buffer.getvalue()


def _toml_block(out: str) -> str:
    lines = out.splitlines()
    start = lines.index("[parallel]")
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("caveats:"))
    return "\n".join(lines[start:end])


@functools.cache
def _result(case: str):
    args = _args(CASES[case][0])
    cfg, work = model_and_workload(args)
    cluster = ClusterConfig(gpu="h100", gpus_per_node=args.gpus_per_node, n_nodes=args.nodes)
    return plan(cfg, cluster, work, KILN, fixed=parse_layout(args.layout) if args.layout else None)


@pytest.mark.parametrize("case", CASES)
def test_printed_tables_load_as_a_recipe_and_launch(case, capsys, tmp_path):
    _, model, (nodes, nproc) = CASES[case]
    out = _output(case)
    assert "ParallelConfig(" not in out
    text = _toml_block(out)
    tables = tomllib.loads(text)
    best = _result(case).ranked[0]
    assert tables["parallel"]["dp_shard"] == best.layout.dp_shard and tables["parallel"]["tp"] == best.layout.tp
    recipe_path = tmp_path / "planned.toml"
    recipe_path.write_text(f"[model]\n{model}\n\n{text}\n")
    recipe = load_recipe(recipe_path)
    par, train = recipe.parallel, recipe.train
    assert (par.dp_replicate, par.dp_shard, par.tp, par.pp, par.cp) == (
        best.layout.dp_replicate,
        best.layout.dp_shard,
        best.layout.tp,
        best.layout.pp,
        best.layout.cp,
    )
    assert train.activation_checkpointing == best.layout.ac
    # The trainer's batch geometry (kiln/train/trainer.py) and the pipeline's split (kiln/parallel/pipeline.py).
    dp = par.dp_replicate * par.dp_shard
    per_micro_step = train.seq_len * train.micro_batch_size * dp
    assert train.global_batch_tokens % per_micro_step == 0
    if par.pp > 1:
        assert train.global_batch_tokens == per_micro_step  # one pipeline round per step
        assert train.micro_batch_size // par.microbatches == best.layout.micro_batch
    else:
        assert train.micro_batch_size == best.layout.micro_batch
    assert par.reshard_after_forward == (best.layout.zero not in (1, 2))

    launch = ["launch", "local", "--nodes", str(nodes), "--nproc", str(nproc), "--dry-run"]
    if nodes > 1:
        launch += ["--rdzv-endpoint", "head:29500"]
    assert run(build_parser(["launch"]).parse_args([*launch, str(recipe_path)])) == 0
    assert "torchrun" in capsys.readouterr().out


def test_tables_merge_into_the_tiny_recipe():
    tables = tomllib.loads(_toml_block(_output("tiny")))
    overrides = [
        f"{t}.{k}={str(v).lower() if isinstance(v, bool) else v}" for t, kv in tables.items() for k, v in kv.items()
    ]
    recipe = load_recipe("recipes/tiny.toml", overrides)
    assert recipe.parallel.dp_shard == tables["parallel"]["dp_shard"]
    assert recipe.train.micro_batch_size == tables["train"]["micro_batch_size"]


def _memory_lines(out: str) -> tuple[float, dict[str, float]]:
    total = float(re.search(r"memory per GPU \(pipeline rank \d+\): ([\d.]+) GB", out).group(1))
    terms = dict((k, float(v)) for k, v in re.findall(r"^    (\w+) +([\d.]+) GB", out, re.M))
    return total, terms


@pytest.mark.parametrize("case", CASES)
def test_memory_terms_add_up_to_the_printed_total(case):
    total, terms = _memory_lines(_output(case))
    mem = _result(case).ranked[0].memory
    assert round(sum(terms.values()), 2) == total
    assert total == pytest.approx(mem.total / GB, abs=0.006)
    assert set(terms) == {"params", "grads", "optimizer", "activations", "logits", "buffers"}
    for key, value in terms.items():
        assert value == pytest.approx(getattr(mem, key) / GB, abs=0.01), key


def _rows(out: str) -> list[tuple[str, str, str]]:
    """(layout, comm, exposed) of each printed ranking row."""
    rows = re.findall(r"^ +\d+  (dp=.+?) {2,}[\d.]+ .* (\S+) +(\S+)$", out, re.M)
    assert rows
    return rows


@pytest.mark.parametrize("case", CASES)
def test_no_row_with_a_collective_shows_free_communication(case):
    out = _output(case)
    for label, comm, exposed in _rows(out):
        degrees = dict(re.findall(r"(dp|tp|pp|cp)=(\d+(?:x\d+)?)", label))
        parallel = any(v != "1" for v in degrees.values())
        if parallel:
            assert comm not in ("0", "0.0%") and exposed != "0.0%", label
    assert "0.0% communication" not in out


def test_unoverlapped_ddp_traffic_is_the_ring_all_reduce():
    """DDP on one node all-reduces the fp32 gradients once a step: 2 (n-1)/n x 4 bytes x params / bw
    plus the latency of 2 (n-1) NVLink ring steps; at least 1 - overlap_efficiency of it is exposed,
    none of it gone from the report."""
    args = _args(["--preset", "tiny", "--seq-len", "256"])
    cfg, _ = model_and_workload(args)
    cluster = ClusterConfig(gpu="h100", gpus_per_node=8)
    est = estimate(cfg, Layout(dp_replicate=8), cluster, Workload(256, 8 * 256 * 8), KILN)
    # rel: the planner leaves the final norm's weights (dim of 7M parameters) out of the gradients.
    latency = NCCL_BASE_LATENCY + 14 * NCCL_STEP_LATENCY["intra"]
    ring = 2 * 7 / 8 * 4 * total_params(cfg) / cluster.intra + latency
    assert est.dp_unoverlapped == pytest.approx(ring, rel=1e-4)
    assert (1 - cluster.overlap_efficiency) * est.dp_unoverlapped <= est.dp_time <= est.dp_unoverlapped


def _pruned(out: str) -> tuple[int, int, int, list[int]]:
    searched, fit, pruned = map(int, re.search(r"searched (\d+) layouts: (\d+) fit, (\d+) pruned", out).groups())
    tail = out[out.index("pruned\n") :]
    return searched, fit, pruned, [int(n) for n in re.findall(r"^ +(\d+)  \S", tail, re.M)]


@pytest.mark.parametrize("case", ["8b-hsdp", "tiny"])
def test_pruned_counts_add_up(case):
    searched, fit, pruned, counts = _pruned(_output(case))
    args = _args(CASES[case][0])
    cfg, work = model_and_workload(args)
    cluster = ClusterConfig(gpu="h100", gpus_per_node=args.gpus_per_node, n_nodes=args.nodes)
    assert searched == len(list(candidates(cfg, cluster, work))) == fit + pruned
    assert sum(counts) == pruned and fit == len(_result(case).ranked)


def test_tied_rows_are_explained():
    out = _output("8b-hsdp")
    rows = _rows(out)
    tie = re.search(r"rows (\d+)-(\d+) tie \(step times within 0.5%\): they differ only in ([\w, ]+);", out)
    assert tie, out
    first, last = int(tie.group(1)), int(tie.group(2))
    assert last > first
    labels = [rows[i][0] for i in range(first - 1, last)]
    assert len(set(labels)) == len(labels)
    assert "cp" in tie.group(3).split(", ") and "assumed hidden behind compute" in out


def test_no_ranked_layout_is_one_the_trainer_refuses():
    """Replicas of a tensor- or pipeline-parallel mesh without sharding (DDP x TP) are refused by
    ParallelConfig; the planner must not rank them."""
    result = _result("8b-hsdp")
    for e in result.ranked:
        e.layout.to_parallel_config(e.microbatches).check_options(e.layout.dp_shard, None)
    assert any("[parallel] dp_replicate" in reason for reason in result.invalid)


def test_a_layout_with_two_problems_is_pruned_once():
    """tp=8 on the tiny model (4 heads, 2 KV heads) fails twice per layout; it is one pruned layout."""
    args = _args(["--preset", "tiny", "--layout", "tp=8"])
    cfg, work = model_and_workload(args)
    cluster = ClusterConfig(gpu="h100", gpus_per_node=8)
    result = plan(cfg, cluster, work, KILN, fixed={"tp": 8})
    forced = [lay for lay in candidates(cfg, cluster, work) if lay.tp == 8]
    searched, fit, pruned, counts = _pruned("\n".join(pruned_lines(result)) + "\n")
    assert (searched, fit, pruned) == (len(forced), 0, len(forced)) and sum(counts) == pruned
    assert sum(result.rejected.values()) > pruned  # the problems themselves outnumber the layouts
