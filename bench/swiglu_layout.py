"""SwiGLU's gate and up projections: one fused matrix with interleaved rows (Kiln's weights layout 2)
against two matrices (layout 3, what ships), forward + backward of one FFN at the bench model's
shape, eager and compiled, fp32 and bf16 autocast, in interleaved rounds of the same process.

The interleaved layout let tensor parallelism split one fused w13 by row chunks; its cost is the
elementwise kernel that reads gate and up as every other column of the matmul output (and, in
backward, writes their gradients back interleaved). "halves" (one matrix, gate rows then up rows,
split with chunk) is shown for reference: it needs no second matmul but cannot be split by row
chunks for tensor parallelism.

    PYTHONPATH=$PWD python bench/swiglu_layout.py [--rounds 15] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from machine import cpu_line


def interleaved(x, w13, w2):
    gate, up = F.linear(x, w13).unflatten(-1, (-1, 2)).unbind(-1)
    return F.linear(F.silu(gate) * up, w2)


def halves(x, w13, w2):
    gate, up = F.linear(x, w13).chunk(2, -1)
    return F.linear(F.silu(gate) * up, w2)


def two_matrices(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def fwd_bwd(fn, weights, x, precision):
    x = x.detach().requires_grad_()
    weights = [w.detach().requires_grad_() for w in weights]
    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        out = fn(x, *weights)
    out.float().sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=6, help="forward+backward calls per contender per round")
    args = parser.parse_args()
    print(cpu_line())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; dim {args.dim}, hidden {args.hidden}, "
        f"{args.tokens} tokens"
    )
    torch.manual_seed(0)
    d, h = args.dim, args.hidden
    x = torch.randn(args.tokens, d)
    w1, w3, w2 = torch.randn(h, d) * 0.02, torch.randn(h, d) * 0.02, torch.randn(d, h) * 0.02
    fused = torch.stack([w1, w3], dim=1).flatten(0, 1)
    cases = {
        "interleaved (layout 2)": (interleaved, [fused, w2]),
        "halves": (halves, [torch.cat([w1, w3]), w2]),
        "two matrices (layout 3)": (two_matrices, [w1, w3, w2]),
    }
    for precision in ("fp32", "bf16"):
        for compiled in (False, True):
            runs = {name: (torch.compile(fn) if compiled else fn, ws) for name, (fn, ws) in cases.items()}
            for fn, ws in runs.values():  # warm-up, compilation included
                for _ in range(3):
                    fwd_bwd(fn, ws, x, precision)
            times = {name: [] for name in runs}
            names = list(runs)
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    fn, ws = runs[name]
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        fwd_bwd(fn, ws, x, precision)
                    times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            base = statistics.median(times["interleaved (layout 2)"])
            mode = "compiled" if compiled else "eager"
            for name, t in times.items():
                med = statistics.median(t)
                print(
                    f"[{precision} {mode}] {name:24s} {med:7.2f} ms (median of {args.rounds})  "
                    f"{base / med:4.2f}x layout 2"
                )


if __name__ == "__main__":
    main()
