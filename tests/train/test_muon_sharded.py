"""Muon over sharded matrices (kiln.train.muon): FSDP's and HSDP's row shards go through two batched
all-to-alls per round of matrices, other layouts through a gather and scatter per matrix; either way
each rank ends with its shard of the single-process update of the whole matrix."""

import copy
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from kiln.train import muon as muon_module
from kiln.train.muon import Muon, orthogonalised_row_shards, row_sharded_dim

WORLD = 4
# Rows that 4 ranks cannot split evenly (5 -> 2, 2, 1, 0; 1 -> 1, 0, 0, 0), tall and wide matrices,
# and six of them: one full round of four and a short one of two, where two ranks own nothing.
SHAPES = [(8, 6), (5, 3), (2, 7), (9, 4), (3, 3), (1, 5)]


def _matrices(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def _orthogonalise(x: torch.Tensor) -> torch.Tensor:
    """The float32 iteration Muon's step applies (torch's default coefficients, steps and eps)."""
    muon = Muon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.02, ns_dtype=torch.float32)
    return muon.orthogonaliser(muon.param_groups[0])(x)


class _Counted:
    """Counts the collectives the step issues, to show the row shards go in rounds."""

    def __init__(self, monkeypatch_target, name):
        self.calls, self.name, self.target = 0, name, monkeypatch_target
        self.original = getattr(monkeypatch_target, name)

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        setattr(self.target, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.target, self.name, self.original)


def check_row_shards(mesh, placements, mesh_dim: int) -> None:
    whole = _matrices(0)
    sharded = [distribute_tensor(m, mesh, placements) for m in whole]
    with _Counted(muon_module.dist, "all_to_all_single") as a2a:
        results = orthogonalised_row_shards(sharded, mesh_dim, _orthogonalise)
    assert a2a.calls == 2 * 2  # two rounds (4 + 2 matrices over 4 shard ranks), two exchanges each
    for m, r, s in zip(whole, results, sharded):
        assert r.placements == s.placements and r.shape == m.shape
        assert r.to_local().shape == s.to_local().shape
        assert torch.equal(r.full_tensor(), _orthogonalise(m))


def check_optimizer_step(mesh, placements, shard_ranks: int) -> None:
    """Muon's step over DTensor matrices (row-sharded ones batched, a column-sharded one gathered
    and scattered) equals its step over the plain matrices, exactly."""
    kwargs = dict(lr=0.02, momentum=0.95, ns_dtype=torch.float32, adjust_lr_fn="match_rms_adamw")
    plain = [torch.nn.Parameter(m) for m in _matrices(1)]
    split_columns = tuple(Shard(1) if p == Shard(0) else p for p in placements)
    layouts = [split_columns if i == 2 else placements for i in range(len(plain))]
    sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, pl)) for p, pl in zip(plain, layouts)]
    reference, under_test = Muon(plain, **kwargs), Muon(sharded, **kwargs)
    for step in range(2):
        grads = _matrices(10 + step)
        for p, q, g, pl in zip(plain, sharded, grads, layouts):
            p.grad, q.grad = g, distribute_tensor(g, mesh, pl)
        reference.step()
        with _Counted(muon_module.dist, "all_to_all_single") as a2a:
            under_test.step()
        assert a2a.calls == 2 * -(-5 // shard_ranks)  # two exchanges per round of the 5 row-sharded matrices
    for p, q in zip(plain, sharded):
        assert torch.equal(q.full_tensor(), p.detach())


def check_fsdp2_shards(mesh) -> None:
    """FSDP2's own gradients (rows 5, 9 and 1 over 4 ranks: uneven and empty shards) take the
    batched exchange, and the step is the one-process step."""
    kwargs = dict(lr=0.02, momentum=0.95, ns_dtype=torch.float32)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*(torch.nn.Linear(i, o, bias=False) for i, o in ((3, 5), (5, 9), (9, 1))))
    sharded = copy.deepcopy(plain)
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    plain(x).square().sum().backward()
    sharded(x).square().sum().backward()
    reference, under_test = Muon(list(plain.parameters()), **kwargs), Muon(list(sharded.parameters()), **kwargs)
    reference.step()
    with _Counted(muon_module.dist, "all_to_all_single") as a2a:
        under_test.step()
    assert a2a.calls == 2  # three matrices, one round of four
    for p, q in zip(plain.parameters(), sharded.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=0, atol=1e-6)


def worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        fsdp = init_device_mesh("cpu", (WORLD,))
        check_row_shards(fsdp, (Shard(0),), 0)
        check_optimizer_step(fsdp, (Shard(0),), WORLD)
        check_fsdp2_shards(fsdp)
        # HSDP: 2 replicas of 2 shards. A round holds 2 matrices, so 6 make 3 rounds.
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        whole = _matrices(0)
        with _Counted(muon_module.dist, "all_to_all_single") as a2a:
            results = orthogonalised_row_shards(
                [distribute_tensor(m, hsdp, (Replicate(), Shard(0))) for m in whole], 1, _orthogonalise
            )
        assert a2a.calls == 2 * 3
        for m, r in zip(whole, results):
            assert torch.equal(r.full_tensor(), _orthogonalise(m))
        check_optimizer_step(hsdp, (Replicate(), Shard(0)), 2)
    finally:
        dist.destroy_process_group()


def test_sharded_muon_matches_the_whole_matrix_update(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=True)


def test_only_row_splits_take_the_batched_exchange():
    def dim(*placements):
        return row_sharded_dim(SimpleNamespace(placements=placements))

    assert dim(Shard(0)) == 0  # FSDP
    assert dim(Replicate(), Shard(0)) == 1  # HSDP
    assert dim(Shard(1)) is None  # tensor parallelism's column split
    assert dim(Shard(0), Shard(0)) is None  # FSDP over tensor parallelism's row split
    assert dim(Shard(0), Shard(1)) is None
    assert dim(Replicate()) is None
