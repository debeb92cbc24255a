"""Activation memory: bytes one Transformer block keeps for backward, per token, measured vs predicted.

Measured with torch.autograd.graph.saved_tensors_hooks (kiln.model.activations: every saved storage
counted once, at its full size, plus what selective checkpointing caches), in fp32 and under bf16
autocast, without activation checkpointing, with the op-level selective policy and with full
checkpointing (kiln.parallel.parallelize.apply_activation_checkpointing). Predicted
by kiln.model.activations.layer_activation_bytes_per_token, and by the planner's
kiln.parallel.plan.layer_activation_bytes (16-bit only), both printed in units of h (the model width).

    python bench/activation_memory.py
    python bench/activation_memory.py --dim 1024 --heads 16 --kv-heads 4 --seq 256
    python bench/activation_memory.py --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.model import ModelConfig, build_model
from kiln.model.activations import layer_activation_bytes_per_token, measured_layer_activation_bytes_per_token
from kiln.model.config import AC_MODES
from kiln.parallel.parallelize import apply_activation_checkpointing
from kiln.parallel.plan import layer_activation_bytes
from kiln.train.precision import autocast

MODES = [(precision, value_bytes, ac) for ac in AC_MODES for precision, value_bytes in (("fp32", 4), ("bf16", 2))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", default="swiglu", choices=["swiglu", "gelu"])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    cfg = ModelConfig(
        vocab_size=256, dim=args.dim, n_layers=1, n_heads=args.heads, n_kv_heads=args.kv_heads, ffn=args.ffn,
        max_seq_len=args.seq,
    )  # fmt: skip
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}\n{cpu_line()}"
    )
    if args.device.startswith("cuda"):
        print(f"device {torch.cuda.get_device_name(args.device)}")
    print(
        f"config: dim={cfg.dim} heads={cfg.n_heads} kv_heads={cfg.kv_heads} ffn={cfg.ffn} "
        f"ffn_hidden={cfg.ffn_hidden_size} seq={args.seq} device={args.device}"
    )
    h = cfg.dim
    print(f"{'mode':<17} {'measured/h':>11} {'formula/h':>10} {'planner/h':>10}")
    for precision, value_bytes, ac in MODES:

        def build(n_layers: int, ac=ac):
            model = build_model(dataclasses.replace(cfg, n_layers=n_layers), device=args.device)
            apply_activation_checkpointing(model, ac)
            return model

        measured = measured_layer_activation_bytes_per_token(
            build, args.seq, cfg.vocab_size, lambda precision=precision: autocast(precision, args.device)
        )
        formula = layer_activation_bytes_per_token(cfg, value_bytes, ac)
        planner = f"{layer_activation_bytes(cfg, args.seq, 1, ac=ac) / h:10.3f}" if value_bytes == 2 else f"{'-':>10}"
        print(f"{precision + ' ' + ac:<17} {measured / h:11.3f} {formula / h:10.3f} {planner}")


if __name__ == "__main__":
    main()
