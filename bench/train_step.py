"""Training-step throughput: Kiln's Transformer vs transformers' LlamaForCausalLM, same config.

Each side is stepped the way its own users run it:
- Kiln as `kiln pretrain` does: bf16 autocast (or fp32), `kiln.train.objective.next_token_loss`,
  backward, gradient clipping at 1.0, and the optimizer from `kiln.train.optim.build_optimizer`
  (AdamW, no decay on norms and embeddings) for a default `TrainConfig`.
- transformers as its documentation and `Trainer` do: `model(input_ids, labels=...)` under the same
  autocast, so the model computes its own float32 cross-entropy, backward, clipping at 1.0 (Trainer's
  default max_grad_norm), `torch.optim.AdamW`. Both sides take the same AdamW implementation
  (--optimizer-impl, default fused: Kiln's shipped recipes set train.optimizer_impl = "fused", and
  Trainer's default `optim` is "adamw_torch_fused" from torch 2.8 on).

Both are timed eager and compiled, each compiled the way its own users would: Kiln as its trainer does
with `train.compile = true`, `torch.compile(next_token_loss)` called with the plain model (so the output
head and the float32 cross-entropy are one graph); transformers as `torch.compile(model)`, whose graph
holds its loss too because the model computes it from `labels`. The optimizer stays eager on both sides. All contenders of one precision take
turns inside every timed round, in an order that turns over from round to round, so a change in machine
speed (thermal, other tenants) hits them alike; the per-round lists are printed so noise can be
judged. Compilation happens in the untimed warmup; its cost is reported separately. Rounds during
which other processes kept more than --max-others CPU cores busy are left out of the medians (and
marked with * in the lists).

MFU is measured against the best square-matmul throughput this machine reaches in the same run and
dtype, so it says how close a step gets to this machine, not to a datasheet.

    python bench/train_step.py                          # fp32 and bf16, eager and compiled
    python bench/train_step.py --precision bf16 --repeats 7
    python bench/train_step.py --no-compile             # eager only (no compile warmup)
    python bench/train_step.py --profile --precision bf16 --no-compile   # + per-op profile, chunked head
    python bench/train_step.py --kernel-profile --precision bf16       # compiled steps, kernel by kernel

--profile adds, per precision: a table of where each eager step's operator time goes (optimizer, loss
head, attention, block matmuls, norms, elementwise/other; bench/step_profile.py) for transformers,
Kiln and Kiln with train.loss_chunk_tokens, and the chunked head against the plain one in Kiln's
step (interleaved rounds, eager and, unless --no-compile, compiled; peak tensor memory of one step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from machine import cpu_line  # bench/ (the script's folder, on sys.path)
from step_profile import OPTIMIZER_SCOPE, format_table, kernel_table, profile_steps, scope_modules
from torch.distributed._tools.mem_tracker import MemTracker
from torch.profiler import record_function

from kiln.model import ModelConfig, build_model, count_params, flops_per_token
from kiln.train.config import TrainConfig
from kiln.train.objective import chunked_next_token_loss, next_token_loss
from kiln.train.optim import build_optimizer
from kiln.train.precision import autocast

GRAD_CLIP = 1.0  # Kiln's TrainConfig.grad_clip default and transformers Trainer's max_grad_norm


def hf_llama(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
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


def optimizer_profile(cfg: ModelConfig, repeats: int, steps: int) -> dict[str, list[float]]:
    """Milliseconds per AdamW step, {train.optimizer_impl: [per round]}, over Kiln's parameter groups
    with one fixed set of gradients. Both implementations take turns inside every round, the order
    turning over, so load from other processes hits them alike."""
    torch.manual_seed(0)
    impls = ("foreach", "fused")
    models = {impl: build_model(cfg) for impl in impls}
    for model in models.values():
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
    optimizers = {impl: build_optimizer(models[impl], TrainConfig(optimizer_impl=impl)) for impl in impls}
    for opt in optimizers.values():  # the first step allocates the moments
        opt.step()
    times = {impl: [] for impl in impls}
    for r in range(repeats):
        for impl in impls[r % 2 :] + impls[: r % 2]:
            start = time.perf_counter()
            for _ in range(steps):
                optimizers[impl].step()
            times[impl].append((time.perf_counter() - start) / steps * 1e3)
    return times


def kiln_step(
    cfg: ModelConfig,
    precision: str,
    compile: bool,
    seq: int,
    batch: int,
    optimizer_impl: str,
    loss_chunk_tokens: int = 0,
):
    torch.manual_seed(0)
    model = build_model(cfg)
    train_cfg = TrainConfig(
        seq_len=seq,
        micro_batch_size=batch,
        global_batch_tokens=seq * batch,
        precision=precision,
        compile=compile,
        optimizer_impl=optimizer_impl,
        loss_chunk_tokens=loss_chunk_tokens,
    )
    optimizer = build_optimizer(model, train_cfg)
    # The same choice and wrapping as Trainer: the chunked head when train.loss_chunk_tokens is set;
    # with train.compile on, the loss function is compiled and the model it calls is not, so dynamo
    # traces the model inline into the loss's graph.
    loss_fn = chunked_next_token_loss(loss_chunk_tokens) if loss_chunk_tokens else next_token_loss
    loss_fn = torch.compile(loss_fn) if compile else loss_fn
    params = list(model.parameters())

    def step(x, y):
        with autocast(precision, "cpu"):
            loss, _ = loss_fn(model, (x, y))
        loss.backward()
        with record_function(OPTIMIZER_SCOPE):  # a profiler scope (--profile); no cost otherwise
            torch.nn.utils.clip_grad_norm_(params, train_cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step.model, step.head = model, model.output
    return step


def hf_step(cfg: ModelConfig, precision: str, compile: bool, optimizer_impl: str = "fused"):
    torch.manual_seed(0)
    model = hf_llama(cfg)
    model.train()
    impl = {"fused": True} if optimizer_impl == "fused" else {"foreach": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **impl)
    forward_model = torch.compile(model) if compile else model

    def step(x, y):
        with autocast(precision, "cpu"):
            # transformers' own causal-LM loss (labels shifted inside, logits upcast to float32).
            loss = forward_model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        with record_function(OPTIMIZER_SCOPE):
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step.model, step.head = model, model.lm_head
    return step


def machine_busy_seconds() -> float:
    """CPU seconds all processes on this machine have used since boot (Linux; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def time_steps(step, x, y, steps: int) -> tuple[float, float]:
    """(wall seconds, CPU cores other processes kept busy meanwhile). The machine this was written
    on is shared; a round in which others used the CPU is slowed by them, not by the model."""
    machine, ours = machine_busy_seconds(), sum(os.times()[:2])
    start = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    wall = time.perf_counter() - start
    others = (machine_busy_seconds() - machine) - (sum(os.times()[:2]) - ours)
    return wall, max(others, 0.0) / wall


def run(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    precision: str,
    repeats: int,
    steps: int,
    warmup: int,
    compile_modes: list[bool],
    optimizer_impl: str,
):
    """({(side, compiled): [tokens/s per round]}, [CPU cores others used, per round (the most over
    its contenders)], {(side, compiled): seconds of the first, compiling, step})."""
    steps_of = {}
    for compiled in compile_modes:
        steps_of[("kiln", compiled)] = kiln_step(cfg, precision, compiled, seq, batch, optimizer_impl)
        steps_of[("transformers", compiled)] = hf_step(cfg, precision, compiled, optimizer_impl)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    first_step = {}
    for key, step in steps_of.items():
        first_step[key] = time_steps(step, x, y, 1)[0]  # compiles forward and backward when compiled
        time_steps(step, x, y, warmup)
    rates = {key: [] for key in steps_of}
    others = []
    # Contenders are grouped by mode (eager, compiled) and each group runs as a block, the blocks and
    # the order inside each block turning over from round to round. Eager sides are then compared
    # with eager predecessors only: right after compiled code, its OpenMP threads keep spinning for
    # a moment and slow whatever runs next.
    groups = [[key for key in steps_of if not key[1]], [key for key in steps_of if key[1]]]
    groups = [g for g in groups if g]
    for r in range(repeats):
        order = []
        for group in groups if r % 2 == 0 else groups[::-1]:
            turn = r % len(group)
            order += group[turn:] + group[:turn]
        busiest = 0.0
        for key in order:
            seconds, busy = time_steps(steps_of[key], x, y, steps)
            rates[key].append(batch * seq * steps / seconds)
            busiest = max(busiest, busy)
        others.append(busiest)
    return rates, others, first_step


def peak_step_bytes(step, x, y) -> int:
    """Peak bytes of CPU tensors alive during one step (parameters, gradients, optimizer state and
    activations), from torch's MemTracker, which follows every tensor's storage."""
    tracker = MemTracker()
    with tracker:
        step(x, y)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def loss_head_report(cfg: ModelConfig, precision: str, args) -> dict:
    """--profile: the per-op table (transformers, Kiln, Kiln chunked; eager), then Kiln's chunked head
    against the plain one: tokens/s in interleaved rounds (eager and compiled) and peak memory."""
    chunk, batch, seq = args.loss_chunk_tokens, args.batch, args.seq
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    profiled = {
        "transformers": hf_step(cfg, precision, False, args.optimizer_impl),
        "kiln": kiln_step(cfg, precision, False, seq, batch, args.optimizer_impl),
        f"kiln chunk {chunk}": kiln_step(cfg, precision, False, seq, batch, args.optimizer_impl, chunk),
    }
    columns = {}
    for name, step in profiled.items():
        scope_modules(step.model, step.head)
        columns[name] = profile_steps(step, x, y, args.profile_steps, cfg.vocab_size)
    print(f"\n[{precision}] eager step profile, ms of operator self time per step (mean of {args.profile_steps}):")
    print("\n".join(format_table(columns)))
    del profiled

    modes = [False] if args.no_compile else [False, True]
    steps_of = {
        (c, compiled): kiln_step(cfg, precision, compiled, seq, batch, args.optimizer_impl, c)
        for compiled in modes
        for c in (0, chunk)
    }
    for step in steps_of.values():
        time_steps(step, x, y, 1 + args.warmup)
    rates = {key: [] for key in steps_of}
    others = []
    keys = list(steps_of)
    for r in range(args.repeats):
        busiest = 0.0
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            seconds, busy = time_steps(steps_of[key], x, y, args.steps)
            rates[key].append(batch * seq * args.steps / seconds)
            busiest = max(busiest, busy)
        others.append(busiest)
    clean = [busy <= args.max_others for busy in others]
    if not any(clean):
        print("  WARNING: other processes used the CPU in every round; using all rounds")
        clean = [True] * len(others)
    print(
        f"[{precision}] Kiln loss head, chunked ({chunk} tokens) vs plain, {args.repeats} rounds x {args.steps} "
        f"steps ({len(clean) - sum(clean)} busy left out; others' cores per round: "
        f"{', '.join(f'{b:.2f}' for b in others)}):"
    )
    row = {}
    for compiled in modes:
        mode = "compiled" if compiled else "eager"
        for c in (0, chunk):
            med = statistics.median(v for v, ok in zip(rates[(c, compiled)], clean) if ok)
            print(f"  {mode:8s} {'chunked' if c else 'plain':8s} {med:7.0f} tokens/s")
        line, row[f"chunked/plain {mode}"] = ratio_line(
            f"{mode}: chunked / plain tokens/s", rates, clean, (chunk, compiled), (0, compiled)
        )
        print(line)
    plain_peak, chunked_peak = (peak_step_bytes(steps_of[(c, False)], x, y) for c in (0, chunk))
    row["peak MiB plain"], row["peak MiB chunked"] = plain_peak / 2**20, chunked_peak / 2**20
    print(
        f"  peak tensor memory of one eager step (MemTracker): plain {plain_peak / 2**20:.0f} MiB, chunked "
        f"{chunked_peak / 2**20:.0f} MiB ({chunked_peak / plain_peak:.2f}x; full fp32 logits are "
        f"{batch * seq * cfg.vocab_size * 4 / 2**20:.0f} MiB)"
    )
    return row


def compiled_kernel_report(cfg: ModelConfig, precision: str, args) -> None:
    """--kernel-profile: where each side's compiled step goes, generated kernels named one by one."""
    import torch._inductor.config as inductor_config  # only this mode needs inductor's settings

    inductor_config.cpp.enable_kernel_profile = True
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen) for _ in range(2))
    for side, step in (
        ("kiln", kiln_step(cfg, precision, True, args.seq, args.batch, args.optimizer_impl)),
        ("transformers", hf_step(cfg, precision, True, args.optimizer_impl)),
    ):
        for _ in range(args.warmup + 1):  # compiles
            step(x, y)
        rows = kernel_table(step, x, y, args.profile_steps)
        print(f"\n[{precision}] {side} compiled step, ms of self time per step (mean of {args.profile_steps}):")
        for name, ms in rows:
            print(f"  {ms:8.1f}  {name[:110]}")


def label(key) -> str:
    side, compiled = key
    return f"{side} {'compiled' if compiled else 'eager'}"


def ratio_line(name: str, rates: dict, clean: list[bool], kiln_key, hf_key) -> tuple[str, float]:
    """Ratio of medians over the clean rounds, plus the median of the per-round ratios (both sides
    ran in the same round, so a per-round ratio cancels load that changed between rounds)."""
    kiln = [r for r, ok in zip(rates[kiln_key], clean) if ok]
    hf = [r for r, ok in zip(rates[hf_key], clean) if ok]
    of_medians = statistics.median(kiln) / statistics.median(hf)
    per_round = [k / h for k, h in zip(kiln, hf)]
    rounds = ", ".join(f"{r:.2f}" for r in per_round)
    return (
        f"  {name:58s} {of_medians:5.2f}x  (per-round median {statistics.median(per_round):.2f}x; {rounds})"
    ), of_medians


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
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per contender per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (compiling) one")
    parser.add_argument("--no-compile", action="store_true", help="time eager mode only")
    parser.add_argument(
        "--max-others",
        type=float,
        default=0.15,
        help="leave out rounds in which other processes kept more CPU cores busy than this",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--optimizer-impl",
        choices=["foreach", "fused"],
        default="fused",
        help="AdamW implementation of both sides: Kiln's train.optimizer_impl, torch.optim.AdamW(fused/foreach=True)",
    )
    parser.add_argument("--no-optimizer-profile", action="store_true", help="skip the fused vs foreach timing")
    parser.add_argument(
        "--profile", action="store_true", help="per-op step profile and chunked vs plain loss head, per precision"
    )
    parser.add_argument("--profile-only", action="store_true", help="with --profile: skip the kiln/transformers timing")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps per contender")
    parser.add_argument(
        "--kernel-profile",
        action="store_true",
        help="only: the largest operators and inductor kernels of both compiled steps, per precision",
    )
    parser.add_argument("--loss-chunk-tokens", type=int, default=256, help="train.loss_chunk_tokens for --profile")
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = ModelConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        max_seq_len=args.seq,
    )
    flops = flops_per_token(cfg, args.seq)
    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print(
        f"config: dim={cfg.dim} layers={cfg.n_layers} heads={cfg.n_heads} kv_heads={cfg.kv_heads} "
        f"ffn={cfg.ffn_hidden_size} vocab={cfg.vocab_size} seq={args.seq} batch={args.batch}; "
        f"params={count_params(cfg) / 1e6:.2f}M ({count_params(cfg, non_embedding=True) / 1e6:.2f}M "
        f"non-embedding); {flops / 1e6:.1f} MFLOP/token"
    )
    if not args.no_optimizer_profile:
        opt_ms = optimizer_profile(cfg, args.repeats, max(args.steps, 3))
        medians = {impl: statistics.median(ms) for impl, ms in opt_ms.items()}
        rounds = "; ".join(f"{impl}: {', '.join(f'{m:.1f}' for m in ms)}" for impl, ms in opt_ms.items())
        print(
            f"\noptimizer step (AdamW over fp32 parameters, any precision): foreach {medians['foreach']:.1f} ms, "
            f"fused {medians['fused']:.1f} ms, fused {medians['foreach'] / medians['fused']:.2f}x faster "
            f"(median of {args.repeats} rounds; ms per round {rounds})"
        )
    print(f"both sides' AdamW below: {args.optimizer_impl!r} (Kiln train.optimizer_impl, torch.optim.AdamW)")
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    compile_modes = [False] if args.no_compile else [False, True]
    summary = []
    for precision in precisions:
        if args.kernel_profile:
            compiled_kernel_report(cfg, precision, args)
            continue
        if args.profile:
            head_row = loss_head_report(cfg, precision, args)
            print("  " + "  ".join(f"{k}={v:.2f}" for k, v in head_row.items()))
            if args.profile_only:
                continue
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        peak = matmul_peak(dtype)
        rates, others, first_step = run(
            cfg,
            args.batch,
            args.seq,
            precision,
            args.repeats,
            args.steps,
            args.warmup,
            compile_modes,
            args.optimizer_impl,
        )
        peak = max(peak, matmul_peak(dtype))  # before and after: a busy moment only lowers it
        clean = [busy <= args.max_others for busy in others]
        busy_rounds = len(clean) - sum(clean)
        if not any(clean):
            print(f"\n[{precision}] WARNING: other processes used the CPU in every round; using all rounds")
            clean = [True] * len(others)
        print(
            f"\n[{precision}] matmul peak {peak / 1e9:.0f} GFLOP/s; {args.repeats} rounds of "
            f"{args.steps} steps x {args.batch * args.seq} tokens; {busy_rounds} left out as busy "
            f"(CPU cores used by other processes per round: {', '.join(f'{b:.2f}' for b in others)})"
        )
        for key, per_round in rates.items():
            median = statistics.median(r for r, ok in zip(per_round, clean) if ok)
            spread = ", ".join(f"{r:.0f}" + ("" if ok else "*") for r, ok in zip(per_round, clean))
            extra = ""
            if key[1]:
                extra = f"  compile ~{first_step[key] - args.batch * args.seq / median:.0f} s"
            print(
                f"  {label(key):26s} {median:7.0f} tokens/s  MFU {median * flops / peak:6.1%}  "
                f"(rounds: {spread}){extra}"
            )
        print("  ratio kiln/transformers (median tokens/s over clean rounds):")
        line, eager = ratio_line("eager vs eager", rates, clean, ("kiln", False), ("transformers", False))
        print(line)
        row = {"precision": precision, "eager": eager}
        if not args.no_compile:
            line, row["compiled"] = ratio_line(
                "compiled vs compiled", rates, clean, ("kiln", True), ("transformers", True)
            )
            print(line)
            # Kiln as configured: the trainer compiles whenever train.compile is on, whatever the
            # precision, and the shipped recipe turns it on; transformers' default is eager.
            line, row["kiln compiled vs hf eager"] = ratio_line(
                "Kiln as configured (train.compile = true) vs transformers eager",
                rates,
                clean,
                ("kiln", True),
                ("transformers", False),
            )
            print(line)
            line, row["kiln compile gain"] = ratio_line(
                "(kiln compiled vs kiln eager)", rates, clean, ("kiln", True), ("kiln", False)
            )
            print(line)
            line, row["hf compile gain"] = ratio_line(
                "(transformers compiled vs transformers eager)",
                rates,
                clean,
                ("transformers", True),
                ("transformers", False),
            )
            print(line)
        row["busy rounds"] = f"{busy_rounds}/{len(clean)}" + (" (all used)" if busy_rounds == len(clean) else "")
        summary.append(row)
    print("\nsummary (ratios of median tokens/s over clean rounds):")
    for row in summary:
        print("  " + "  ".join(f"{k}={v:.2f}x" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
