"""Training-step throughput: Kiln's Transformer vs transformers' LlamaForCausalLM, same config.

One step = forward, float32 cross-entropy, backward, torch.optim.AdamW step, for both models, in the
same process. Repeats alternate between the two models (A, B, A, B, ...) so that drift in machine speed
(thermal, other tenants) hits both alike; we report the median tokens/s of each and their ratio.
MFU is measured against the best matmul throughput this machine reaches in the same run and dtype,
so it says how close a step gets to the machine, not to a datasheet.

    python bench/train_step.py                      # fp32 and bf16 autocast, default config
    python bench/train_step.py --precision bf16 --repeats 7
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from kiln.model import ModelConfig, build_model, count_params, flops_per_token


def hf_llama(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False,
    )
    hf_cfg._attn_implementation = "sdpa"  # transformers' fastest CPU attention path
    return LlamaForCausalLM(hf_cfg)


def matmul_peak(dtype: torch.dtype, size: int = 2048, reps: int = 10) -> float:
    """Best FLOP/s of a square matmul, the practical ceiling for this machine and dtype. The best of
    several runs, because a busy machine only ever makes a run slower."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    for _ in range(3):  # warm up kernel selection, caches and the CPU clock
        torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def make_step(model, logits_of, precision: str, lr: float = 3e-4):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext

    def step(x, y):
        with autocast():
            logits = logits_of(model, x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def time_steps(step, x, y, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    return time.perf_counter() - start


def run(cfg: ModelConfig, batch: int, seq: int, precision: str, repeats: int, steps: int, warmup: int):
    torch.manual_seed(0)
    kiln = build_model(cfg)
    torch.manual_seed(0)
    hf = hf_llama(cfg)
    contenders = {
        "kiln": make_step(kiln, lambda m, x: m(x), precision),
        "transformers": make_step(hf, lambda m, x: m(input_ids=x, use_cache=False).logits, precision),
    }
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    y = torch.randint(0, cfg.vocab_size, (batch, seq))
    for step in contenders.values():
        time_steps(step, x, y, warmup)
    rates = {name: [] for name in contenders}
    for r in range(repeats):
        # Alternate which model goes first so neither always runs right after the other's allocations.
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            seconds = time_steps(contenders[name], x, y, steps)
            rates[name].append(batch * seq * steps / seconds)
    return {name: statistics.median(v) for name, v in rates.items()}, rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--n-layers", type=int, default=6)
    parser.add_argument("--n-heads", type=int, default=6)
    parser.add_argument("--n-kv-heads", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=5, help="timed A/B rounds (median reported)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per timed round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                      n_kv_heads=args.n_kv_heads, max_seq_len=args.seq)
    flops = flops_per_token(cfg, args.seq)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"config: dim={cfg.dim} layers={cfg.n_layers} heads={cfg.n_heads} kv_heads={cfg.kv_heads} "
          f"ffn={cfg.ffn_hidden_size} vocab={cfg.vocab_size} seq={args.seq} batch={args.batch}; "
          f"params={count_params(cfg) / 1e6:.2f}M ({count_params(cfg, non_embedding=True) / 1e6:.2f}M "
          f"non-embedding); {flops / 1e6:.1f} MFLOP/token")
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    for precision in precisions:
        peak = matmul_peak(torch.bfloat16 if precision == "bf16" else torch.float32)
        medians, rates = run(cfg, args.batch, args.seq, precision, args.repeats, args.steps, args.warmup)
        print(f"\n[{precision}] matmul peak {peak / 1e9:.0f} GFLOP/s")
        for name, rate in medians.items():
            spread = ", ".join(f"{r:.0f}" for r in rates[name])
            print(f"  {name:13s} {rate:8.0f} tokens/s  MFU {rate * flops / peak:6.1%}  best {max(rates[name]):.0f}"
                  f"   (rounds: {spread})")
        best_ratio = max(rates["kiln"]) / max(rates["transformers"])
        print(f"  ratio kiln/transformers: {medians['kiln'] / medians['transformers']:.2f}x (median), "
              f"{best_ratio:.2f}x (best round)")


if __name__ == "__main__":
    main()
