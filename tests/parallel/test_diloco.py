"""DiLoCo (kiln.parallel.diloco) on a 2- or 3-rank gloo mesh, checked by replaying the outer loop.

The ranks (tests/parallel/diloco_worker.py) record the weights each replica held before every outer
all-reduce; the test recomputes the expected anchor from those with its own arithmetic and
torch.optim.SGD, so the averaging, the outer momentum and the schedule are each checked against
code outside kiln.parallel.diloco.
"""

import importlib.util
import json
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from kiln.errors import ConfigError
from kiln.model.weights import load_weights
from kiln.parallel.config import ParallelConfig
from kiln.parallel.diloco import fragments_due, split_fragments

sys.path.insert(0, str(Path(__file__).parent))  # spawned ranks import the worker by this path
import diloco_worker  # noqa: E402

OUTER = dict(lr=0.7, momentum=0.9, nesterov=True)


def spawn(tmp_path, world: int, scenarios: list[dict]) -> Path:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(diloco_worker.main, args=(world, f"tcp://127.0.0.1:{port}", str(tmp_path), scenarios), nprocs=world)
    return tmp_path


def replay(folder: Path, outer_steps: int, fragments: int, syncs: int, lr, momentum, nesterov) -> list[torch.Tensor]:
    """The anchor after `syncs` outer steps, from the recorded replica weights: for each sync, the
    members' mean of (anchor - local) steps a torch SGD over that fragment's anchors."""
    anchor = [p.detach().clone() for p in diloco_worker.make_model().parameters()]
    groups = split_fragments(anchor, fragments)
    outer = torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=nesterov)
    for k in range(syncs):
        records = [torch.load(f, weights_only=True) for f in sorted(folder.glob(f"sync{k}-rank*.pt"))]
        index = groups[records[0]["fragment"]]
        for a in anchor:
            a.grad = None
        for i in index:
            anchor[i].grad = torch.stack([anchor[i] - r["params"][i] for r in records]).mean(0)
        outer.step()
    return anchor


def assert_weights(folder: Path, rank: int, expected: list[torch.Tensor], atol=1e-6, kind="final") -> None:
    final = torch.load(folder / f"{kind}-rank{rank}.pt", weights_only=True)
    for got, want in zip(final, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=atol)


def calls(folder: Path, rank: int) -> dict:
    return json.loads((folder / f"calls-rank{rank}.json").read_text())


def test_diloco_on_two_gloo_ranks(tmp_path):
    """H=1 with an outer SGD of lr 1 is DDP; H=4 all-reduces 4x less and matches the replay;
    streaming sends a quarter of the model per sync, one fragment per step."""
    steps = 8
    out = spawn(
        tmp_path,
        2,
        [
            {"name": "ddp", "ddp": True, "steps": steps},
            {
                "name": "h1",
                "steps": steps,
                "inner": "sgd",
                "outer_steps": 1,
                "lr": 1.0,
                "momentum": 0.0,
                "nesterov": False,
            },
            {"name": "h4", "steps": steps, "outer_steps": 4, **OUTER},
            {"name": "stream", "steps": steps, "outer_steps": 4, "fragments": 4, **OUTER},
        ],
    )
    # Inner SGD is linear in the gradient, so averaging the replicas' weights after each step is
    # averaging their gradients: DDP's update, up to the order of fp32 sums (not bit-exact: DiLoCo
    # averages theta - (theta - lr g), DDP averages g).
    ddp = torch.load(out / "ddp" / "ddp-rank0.pt", weights_only=True)
    for rank in (0, 1):
        assert_weights(out / "h1", rank, ddp, atol=1e-6)
    assert len(calls(out / "h1", 0)["calls"]) == steps

    n_params = sum(p.numel() for p in diloco_worker.make_model().parameters())
    expected = replay(out / "h4", 4, 1, steps // 4, **OUTER)
    for rank in (0, 1):
        assert_weights(out / "h4", rank, expected)
        assert calls(out / "h4", rank)["calls"] == [n_params] * (steps // 4)

    # After step 8 only fragment 0 has just synced; the others are mid-round: compare the anchors.
    expected = replay(out / "stream", 4, 4, steps, **OUTER)
    for rank in (0, 1):
        assert_weights(out / "stream", rank, expected, kind="anchor")
    sizes = calls(out / "stream", 0)["calls"]
    fragments = [sum(p.numel() for p in f) for f in _fragment_params(4)]
    # One fragment per step (4 fragments, H = 4): fragment f after steps f, f + 4 (fragment 0 after 4, 8).
    assert sizes == (fragments[1:] + fragments[:1]) * 2
    assert sum(sizes) == 2 * n_params


def _fragment_params(fragments: int) -> list[list[torch.Tensor]]:
    params = list(diloco_worker.make_model().parameters())
    return [[params[i] for i in f] for f in split_fragments(params, fragments)]


@pytest.mark.slow
def test_a_replica_that_dies_mid_round_is_dropped(tmp_path):
    """3 replicas; the last exits during the second round. The two survivors wait out the join
    timeout, average between themselves and finish with the replay's weights over the survivors."""
    steps, h = 8, 2
    out = spawn(
        tmp_path,
        3,
        [{"name": "fault", "steps": steps, "outer_steps": h, "join_timeout_s": 3.0, "die_at_round": 1, **OUTER}],
    )
    folder = out / "fault"
    assert not (folder / "final-rank2.pt").exists()
    assert len(list(folder.glob("sync0-rank*.pt"))) == 3 and len(list(folder.glob("sync1-rank*.pt"))) == 2
    expected = replay(folder, h, 1, steps // h, **OUTER)
    for rank in (0, 1):
        assert calls(folder, rank)["members"] == [0, 1]
        assert_weights(folder, rank, expected)


def test_fragment_schedule_staggers_and_each_fragment_syncs_every_h_steps():
    params = [torch.zeros(n) for n in (10, 1, 30, 5, 5, 40, 9)]
    groups = split_fragments(params, 3)
    assert sorted(i for g in groups for i in g) == list(range(7)) and all(groups)
    assert [i for g in groups for i in g] == list(range(7))  # consecutive runs
    schedule = {step: fragments_due(step, 6, 3) for step in range(1, 13)}
    assert schedule == {1: [], 2: [1], 3: [], 4: [2], 5: [], 6: [0], 7: [], 8: [1], 9: [], 10: [2], 11: [], 12: [0]}


@pytest.mark.parametrize(
    "parallel, key",
    [
        ({"outer_steps": 10}, "outer_steps: is set but outer is 'none'"),
        ({"outer": "local"}, "outer: must be one of none, diloco"),
        ({"outer": "diloco", "outer_steps": 10, "outer_fragments": 3}, "outer_fragments: must divide outer_steps=10"),
        ({"outer": "diloco", "outer_momentum": 0.0}, "outer_nesterov: needs outer_momentum > 0"),
        ({"outer": "diloco", "dp_replicate": 2, "tp": 2}, "outer: diloco averages whole replicas; tp=2"),
        ({"outer": "diloco", "dp_shard": 2}, "outer: .*dp_shard=2 would shard them"),
        ({"outer": "diloco", "dp_shard": 1}, "outer: diloco needs data-parallel replicas .* one replica"),
    ],
)
def test_diloco_options_are_refused_where_they_cannot_apply(parallel, key):
    with pytest.raises(ConfigError, match=key):
        ParallelConfig(**parallel).validate()


# ---- through the Trainer (torchrun, tests/parallel/layout_worker.py) -------------------------------

_spec = importlib.util.spec_from_file_location("layout_cases", Path(__file__).with_name("test_layouts.py"))
_layouts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_layouts)
# Streaming, so that the checkpoint of step 2 falls mid-round for fragment 0 (it syncs at 4, 8):
# resuming needs each replica's own weights as well as the anchor and the outer momentum.
STREAMING = {"dp_replicate": 2, "dp_shard": 1, "outer": "diloco", "outer_steps": 4, "outer_fragments": 2}


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


@pytest.mark.slow
def test_trainer_diloco_resumes_exactly(pack, tmp_path):
    """A run killed after step 3 and resumed from step 2's checkpoint ends bit-identical to one
    that was never interrupted."""
    whole, faulty = tmp_path / "whole", tmp_path / "faulty"
    _layouts.launch(pack, whole, 2, STREAMING, resume="auto")
    _layouts.launch(pack, faulty, 2, STREAMING, resume="auto", kill=(1, 2), max_restarts=1)
    summary = json.loads((faulty / "summary-2.json").read_text())
    assert summary["resumed_from"].endswith("step-00000002")
    assert _layouts.losses(faulty) == _layouts.losses(whole)
    expected = load_weights(whole / "checkpoints")[1]
    got = load_weights(faulty / "checkpoints")[1]
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_more_fragments_than_parameter_tensors_is_refused():
    with pytest.raises(ConfigError, match="outer_fragments: 5 fragments for a model of 4 parameter tensors"):
        split_fragments(list(diloco_worker.make_model().parameters()), 5)
