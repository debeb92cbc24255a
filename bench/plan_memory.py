"""The planner's memory model vs a real trainer step on the CPU, term by term (issue 15).

For a dense and an MoE model in fp32 and bf16, with and without activation checkpointing, one
optimizer step of kiln.train.trainer.Trainer runs with gradient accumulation and
kiln.train.memcheck measures the bytes of the tensors it holds (parameters, gradients at their peak,
optimizer state, autocast's weight copies, the activations saved through one micro-batch's forward,
the loss side); kiln.parallel.plan_check.trainer_memory predicts each term from the planner's formulas.

    python bench/plan_memory.py
    python bench/plan_memory.py --dim 512 --layers 4 --seq 256 --micro-batch 2 --accum 2
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import torch
from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.model import ModelConfig
from kiln.train.config import TrainConfig
from kiln.train.memcheck import check_config, format_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--accum", type=int, default=2)
    args = parser.parse_args()
    dense = ModelConfig(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
        max_seq_len=args.seq,
    )  # fmt: skip
    models = {"dense": dense, "moe (every 2nd layer, 8 experts, top 2)": dataclasses.replace(dense, moe_every=2)}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n{cpu_line()}")
    print(
        f"dim={args.dim} layers={args.layers} heads={args.heads}/{args.kv_heads} vocab={args.vocab} "
        f"seq={args.seq} micro_batch={args.micro_batch} accum={args.accum}; bytes"
    )
    for name, cfg in models.items():
        for precision in ("fp32", "bf16"):
            for ac in ("none", "full"):
                train = TrainConfig(
                    seq_len=args.seq,
                    micro_batch_size=args.micro_batch,
                    global_batch_tokens=args.seq * args.micro_batch * args.accum,
                    precision=precision,
                    activation_checkpointing=ac,
                    warmup_steps=1,
                )
                with tempfile.TemporaryDirectory() as out:
                    rows = check_config(cfg, train, out)
                print(f"\n{name}, {precision}, ac={ac}\n{format_rows(rows)}")


if __name__ == "__main__":
    main()
