"""Ranks of tests/parallel/test_diloco.py, started by torch.multiprocessing.spawn on gloo.

Each scenario trains a small MLP on rank-dependent random batches and writes what the test needs
into `out`: the weights every replica held just before each outer all-reduce (so the test can
replay the outer optimizer itself), the final weights, and the all-reduce calls (sizes) seen."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from kiln.parallel.diloco import DiLoCo

DIM = 8
ORIGINAL_ALL_REDUCE = dist.all_reduce


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, DIM, generator=g)
    return x, x.sum(1, keepdim=True).sin()


def inner_step(model, forward, opt, rank: int, step: int) -> None:
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(forward(x), y).backward()
    opt.step()
    opt.zero_grad()


def counting_all_reduce(calls: list):
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    return counted


def run_diloco(rank, out: Path, steps, die_at_round=None, inner="adamw", **outer) -> torch.nn.Module:
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2) if inner == "adamw" else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    diloco = DiLoCo(params, group=dist.group.WORLD, **outer)
    calls: list[int] = []
    dist.all_reduce = counting_all_reduce(calls)
    sync = diloco.sync

    def recorded_sync(fragment):
        if die_at_round is not None and rank == dist.get_world_size() - 1 and diloco.syncs == die_at_round:
            os._exit(0)  # dies mid-round: its inner steps done, never checking in
        torch.save(
            {"fragment": fragment, "params": [p.detach().clone() for p in params]},
            out / f"sync{diloco.syncs}-rank{rank}.pt",
        )
        sync(fragment)

    diloco.sync = recorded_sync
    try:
        for step in range(1, steps + 1):
            inner_step(model, model, opt, rank, step)
            diloco.after_step(step)
    finally:
        dist.all_reduce = ORIGINAL_ALL_REDUCE
    torch.save([p.detach().clone() for p in params], out / f"final-rank{rank}.pt")
    torch.save([a.clone() for a in diloco.anchor], out / f"anchor-rank{rank}.pt")
    (out / f"calls-rank{rank}.json").write_text(json.dumps({"calls": calls, "members": diloco.members}))
    dist.barrier(group=diloco.group)
    return model


def run_ddp(rank, out: Path, steps) -> None:
    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, steps + 1):
        inner_step(model, ddp, opt, rank, step)
    torch.save([p.detach().clone() for p in model.parameters()], out / f"ddp-rank{rank}.pt")


def main(rank: int, world: int, init: str, out: str, scenarios: list[dict]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    for scenario in scenarios:
        scenario = dict(scenario)
        folder = Path(out) / scenario.pop("name")
        folder.mkdir(parents=True, exist_ok=True)
        if scenario.pop("ddp", False):
            run_ddp(rank, folder, scenario["steps"])
        else:
            run_diloco(rank, folder, **scenario)
