"""Muon's orthogonalisation of FSDP-sharded matrices on N gloo ranks: Kiln's batched row-shard
exchange (two all-to-alls per round of N matrices; kiln.train.muon.orthogonalised_row_shards), the
per-matrix gather and scatter it replaced (orthogonalised_shard, still what tensor-parallel layouts
take), and torch.optim.Muon stepped directly on the DTensor parameters, which is what FSDP2 with
torch's optimizer does.

Every rank holds the bench model's block matrices as FSDP2 holds them (DTensors, Shard(0) over a
1-D mesh of all ranks) with random gradients; each contender produces every matrix's orthogonalised
update (the optimizer's step for torch), timed between barriers, medians over --repeats. Kiln's two
paths are checked equal to each other exactly before timing.

    PYTHONPATH=. python bench/muon_sharded.py                       # 2 ranks, the train-step model
    PYTHONPATH=. python bench/muon_sharded.py --ranks 4 --dim 768 --n-layers 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from machine import cpu_line  # bench/ (the script's folder, on sys.path)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from kiln.model import ModelConfig, build_model
from kiln.train.muon import Muon, lr_scale, muon_split, orthogonalised_row_shards, orthogonalised_shard


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def worker(rank: int, world: int, init_file: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    mesh = init_device_mesh("cpu", (world,))
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads)
    torch.manual_seed(0)
    matrices, _ = muon_split(build_model(cfg))
    grads = [distribute_tensor(torch.randn_like(p) * 1e-3, mesh, (Shard(0),)) for p in matrices]
    # The iteration Kiln's Muon steps with, torch's default coefficients, steps and eps.
    kiln_muon = Muon([torch.nn.Parameter(torch.zeros(2, 2))], ns_dtype=getattr(torch, args.ns_dtype))
    orthogonalise = kiln_muon.orthogonaliser(kiln_muon.param_groups[0])

    def per_matrix():
        return [orthogonalised_shard(g, i, orthogonalise) for i, g in enumerate(grads)]

    def batched():
        return orthogonalised_row_shards(grads, 0, orthogonalise)

    expected = batched()
    for a, b in zip(per_matrix(), expected):
        assert torch.equal(a.to_local(), b.to_local()), "the two exchanges disagree"
    params = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, (Shard(0),))) for p in matrices]
    for p, g in zip(params, grads):
        p.grad = g
    # torch's first step from zero momentum moves each matrix by lr * its shape factor times the
    # bf16 orthogonalisation of a multiple of the gradient: the same update, to bf16 rounding.
    lr = 1e-3
    torch_muon = torch.optim.Muon(params, lr=lr)
    before = [p.detach().to_local().clone() for p in params]
    torch_muon.step()
    torch_error = max(
        ((b - p.detach().to_local()) / (lr * lr_scale(None, p.shape)) - e.to_local()).abs().max().item()
        for b, p, e in zip(before, params, expected)
    )
    results = {
        "kiln batched row shards": timed(batched, args.repeats),
        "kiln per-matrix gather/scatter": timed(per_matrix, args.repeats),
    }
    if args.ns_dtype == "bfloat16":  # torch's Muon iterates in bf16 only
        results["torch.optim.Muon on DTensors"] = timed(torch_muon.step, args.repeats)
    if rank == 0:
        elements = sum(p.numel() for p in matrices)
        print(
            f"{world} gloo ranks x {args.threads} threads; model dim {cfg.dim}, {cfg.n_layers} layers: "
            f"{len(matrices)} Muon matrices, {elements / 1e6:.1f}M elements; Newton-Schulz in {args.ns_dtype}"
        )
        print(f"collectives per step: batched {2 * -(-len(matrices) // world)}, per-matrix {2 * len(matrices)}")
        if args.ns_dtype == "bfloat16":
            print(f"torch.optim.Muon's update against Kiln's, largest difference: {torch_error:.2e} (bf16 rounding)")
        medians = {name: statistics.median(t) for name, t in results.items()}
        for name, times in results.items():
            print(f"  {name:32s} {medians[name]:9.1f} ms  ({', '.join(f'{t:.1f}' for t in times)})")
        base = medians["kiln batched row shards"]
        for name, ms in medians.items():
            if name != "kiln batched row shards":
                print(f"  kiln batched / {name}: {ms / base:.2f}x faster")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--n-layers", type=int, default=6)
    parser.add_argument("--n-heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.ranks, os.path.join(tmp, "rendezvous"), args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
