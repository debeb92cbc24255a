"""One optimizer step of Muon (train.optimizer = "muon") against fused AdamW on the bench model, with
the Newton-Schulz matmuls in bf16 (torch.optim.Muon's) and in float32 (train.muon_ns_dtype).

On a CPU without bf16 kernels (AVX2 only) torch's bf16 iteration runs through a reference loop;
this prints what each choice costs on this machine, and what train.muon_ns_dtype = "auto" picks.

    PYTHONPATH=. python bench/muon_step.py
    PYTHONPATH=. python bench/muon_step.py --dim 768 --n-layers 12 --skip bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.model import ModelConfig, build_model, count_params
from kiln.train.config import TrainConfig
from kiln.train.muon import ns_dtype
from kiln.train.optim import build_optimizer


def step_ms(model, cfg: TrainConfig, repeats: int) -> list[float]:
    opt = build_optimizer(model, cfg)
    opt.step()  # allocates the state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--n-layers", type=int, default=6)
    parser.add_argument("--n-heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated Newton-Schulz dtypes to leave out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads)
    torch.manual_seed(0)
    model = build_model(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    print(f"model: dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}: {count_params(cfg) / 1e6:.1f}M params")
    auto = ns_dtype(TrainConfig(optimizer="muon"), "cpu")
    print(f'train.muon_ns_dtype = "auto" on this CPU: {str(auto).removeprefix("torch.")}')
    runs = {"adamw (fused)": TrainConfig(optimizer="adamw", optimizer_impl="fused")}
    for name in ("float32", "bfloat16"):
        if name not in args.skip.split(","):
            runs[f"muon, Newton-Schulz in {name}"] = TrainConfig(
                optimizer="muon", optimizer_impl="fused", muon_ns_dtype=name
            )
    medians = {}
    for name, train_cfg in runs.items():
        times = step_ms(model, train_cfg, args.repeats)
        medians[name] = statistics.median(times)
        print(f"  {name:32s} {medians[name]:10.1f} ms per step  ({', '.join(f'{t:.1f}' for t in times)})")
    base = medians["adamw (fused)"]
    for name, ms in medians.items():
        if name.startswith("muon"):
            print(f"  {name}: {ms / base:.1f}x AdamW's step")
    if len(medians) == 3:
        print(
            f"  bf16 / float32 Newton-Schulz: {medians['muon, Newton-Schulz in bfloat16'] / medians['muon, Newton-Schulz in float32']:.1f}x"
        )


if __name__ == "__main__":
    main()
