"""Generation speed of the KV-cache engine vs transformers `generate`, and what weight-only quantisation
costs in perplexity.

Speed: one Kiln model (random init, seed 0; dim 384, 6 layers, vocab 8192 by default) is exported with
kiln.hf.export_hf and loaded back by transformers' AutoModelForCausalLM (SDPA attention), so both sides
run the same weights. Each contender decodes greedily from the same prompts, without stop tokens, so
every row makes exactly --new-tokens tokens. Decode tokens/s = (new - 1) * batch / (t(new) - t(1)):
t(1) is prefill plus the first token, so the difference is the decode steps alone. Contenders take
turns inside every round (the order rotates), rounds in which other processes kept more than
--max-others CPU cores busy (from /proc/stat) are starred and left out of the medians.

Contenders: transformers fp32 / bf16 (`generate(do_sample=False)`, its default DynamicCache); Kiln
Engine fp32 / bf16; Kiln fp32 and bf16 with prepacked oneDNN weights (kiln.infer.quant.prepack_model;
bf16 only where oneDNN has bf16 kernels, i.e. not on an AVX2-only CPU); and Kiln
with int8 / int4 weights (kiln.infer.quant.quantize_model on the bf16 model, bf16 activations, torch's
int8/int4 CPU kernels). Greedy tokens of Kiln fp32 and transformers fp32 are compared as a check that
both do the same work.

Perplexity: a trained checkpoint (--ckpt, default the tiny recipe's runs/tiny/pretrain) on the
validation split of its token pack (--pack), for fp32, bf16 and each quantisation scheme. Without a
checkpoint this part is skipped (a random model's perplexity says nothing about quantisation).

Speculative decoding (--speculative): the checkpoint as target, a small draft distilled from it here
for --draft-steps steps on the same pack; greedy output checked identical (fp32), then greedy tokens/s
at batch 1 with and without the draft (bf16, prepacked).

    python bench/generate.py                      # speed at batch 1 and 8, perplexity table
    python bench/generate.py --batches 1 --rounds 3 --skip-ppl
    python bench/generate.py --speculative

Kiln with the compiled static-shape decode step (Engine(compile_decode=True)) runs beside the eager
engine in fp32 and bf16 (--skip-compiled leaves it out); its first call, in the warm-up, compiles.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.infer.engine import Engine
from kiln.infer.quant import model_bytes, onednn_packs_bf16, prepack_model, quantize_model, quantized_bits_per_param
from kiln.model import ModelConfig, build_model, count_params


def machine_busy_seconds() -> float:
    """CPU seconds all processes on this machine have used since boot (Linux; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU cores other processes kept busy meanwhile)."""
    machine, ours = machine_busy_seconds(), sum(os.times()[:2])
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    others = (machine_busy_seconds() - machine) - (sum(os.times()[:2]) - ours)
    return wall, max(others, 0.0) / wall


# ---- contenders -----------------------------------------------------------------------------------


def hf_generate(model):
    def run(prompts: torch.Tensor, new: int) -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, prompts.shape[1] :].tolist()

    return run


def kiln_generate(model, compile_decode: bool = False):
    engine = Engine(model, compile_decode=compile_decode)

    def run(prompts: torch.Tensor, new: int) -> list[list[int]]:
        return [c.ids for c in engine.generate(prompts.tolist(), new, temperature=0)]

    return run


def contenders(base, export_dir: Path, schemes: list[str], compiled: bool) -> dict:
    from transformers import AutoModelForCausalLM

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf = AutoModelForCausalLM.from_pretrained(export_dir, dtype=dtype, attn_implementation="sdpa").eval()
        out[f"transformers {name}"] = hf_generate(hf)
        out[f"kiln {name}"] = kiln_generate(copy.deepcopy(base).to(dtype))
        if compiled:
            out[f"kiln {name} compiled"] = kiln_generate(copy.deepcopy(base).to(dtype), compile_decode=True)
    # oneDNN packs bf16 only with AVX512-BW/VL/DQ or AVX-NE-CONVERT (prepack_model refuses it on AVX2).
    packed_dtypes = [("fp32", torch.float32)]
    if onednn_packs_bf16():
        packed_dtypes.append(("bf16", torch.bfloat16))
    else:
        print("kiln bf16 prepacked: left out, this CPU has no oneDNN bf16 kernels (AVX2 only)")
    for name, dtype in packed_dtypes:
        out[f"kiln {name} prepacked"] = kiln_generate(prepack_model(copy.deepcopy(base).to(dtype)))
        if compiled:
            packed = prepack_model(copy.deepcopy(base).to(dtype))
            out[f"kiln {name} prepacked compiled"] = kiln_generate(packed, compile_decode=True)
    for scheme in schemes:
        kind, _, group = scheme.partition("-g")
        model = quantize_model(copy.deepcopy(base).to(torch.bfloat16), kind, int(group) if group else None)
        out[f"kiln {scheme}"] = kiln_generate(model)
    return out


def decode_rates(runs: dict, prompts: torch.Tensor, new: int, rounds: int):
    """{name: [decode tokens/s per round]}, [busiest other-process load per round]."""
    batch = prompts.shape[0]
    for name, run in runs.items():  # warm up allocator, oneDNN primitives, lazy imports; compile
        # The full length, so that the compiled decoders trace the cache length the rounds use.
        warm, _ = timed(lambda: run(prompts, new))
        if "compiled" in name:
            print(f"  [batch {batch}] {name}: first call (compiles the decode step) {warm:.1f} s")
    names = list(runs)
    rates, others = {n: [] for n in names}, []
    for r in range(rounds):
        turn = r % len(names)
        busiest = 0.0
        for name in names[turn:] + names[:turn]:
            first, busy1 = timed(lambda: runs[name](prompts, 1))
            full, busy2 = timed(lambda: runs[name](prompts, new))
            rates[name].append((new - 1) * batch / max(full - first, 1e-9))
            busiest = max(busiest, busy1, busy2)
        others.append(busiest)
    return rates, others


def report_speed(rates: dict, others: list[float], max_others: float, batch: int) -> dict:
    clean = [b <= max_others for b in others]
    if not any(clean):
        print("  WARNING: other processes used the CPU in every round; all rounds used")
        clean = [True] * len(others)
    medians = {n: statistics.median(r for r, ok in zip(v, clean) if ok) for n, v in rates.items()}
    print(
        f"\n[batch {batch}] decode tokens/s, median of clean rounds (other processes' CPU cores per round: "
        f"{', '.join(f'{b:.2f}' for b in others)}; * = left out)"
    )
    for name, per_round in rates.items():
        base = "transformers fp32" if "fp32" in name else "transformers bf16"
        ratio = "" if name.startswith("transformers") else f"  {medians[name] / medians[base]:5.2f}x vs {base}"
        if name.endswith(" compiled") and name.removesuffix(" compiled") in medians:
            ratio += f", {medians[name] / medians[name.removesuffix(' compiled')]:4.2f}x vs eager"
        spread = ", ".join(f"{v:.0f}" + ("" if ok else "*") for v, ok in zip(per_round, clean))
        print(f"  {name:28s} {medians[name]:7.1f}{ratio}   (rounds: {spread})")
    return medians


# ---- perplexity -----------------------------------------------------------------------------------


def load_checkpoint(path):
    """(model, the validation loss its manifest records). Checkpoints written before the fused-row
    layout change are converted by load_weights (kiln.model.weights.upgrade_layout)."""
    from kiln.model.weights import load_weights

    cfg, state, manifest = load_weights(path)
    model = build_model(cfg)
    model.load_state_dict(state)
    return model.eval(), manifest.get("val_loss")


@torch.inference_mode()
def perplexity(model, batches) -> float:
    total, count = 0.0, 0
    for x, y in batches:
        logits = model(x).float()
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return math.exp(total / count)


def ppl_table(ckpt: str, pack: str, windows: int) -> None:
    from kiln.data.loader import TokenLoader
    from kiln.errors import ConfigError

    base, recorded = load_checkpoint(ckpt)
    cfg = base.cfg
    loader = TokenLoader(pack, "val", seq_len=cfg.max_seq_len, batch_size=8)
    batches = list(loader.iter_batches(max(1, windows // 8)))
    tokens = sum(y.numel() for _, y in batches)
    print(
        f"\nperplexity: {ckpt} (dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}, "
        f"{count_params(cfg) / 1e6:.1f}M params), "
        f"{tokens} validation tokens of {pack}"
    )
    loss = math.log(perplexity(base, batches))
    # Validation subsets differ by up to ~1 nat on this corpus; weights that do not fit the code are
    # near or above log(vocab) (~9 for 8192 tokens).
    if recorded is not None and abs(loss - recorded) > 2.0:
        print(
            f"  the checkpoint does not reproduce its recorded validation loss ({loss:.2f} here, {recorded:.2f} "
            f"recorded): its weights do not fit this model code; perplexity table skipped"
        )
        return
    variants = [
        ("fp32", torch.float32, None),
        ("bf16", torch.bfloat16, None),
        ("int8 (fp32 compute)", torch.float32, ("int8", None, True)),
        ("int8", torch.bfloat16, ("int8", None, True)),
        ("int4 g32", torch.bfloat16, ("int4", 32, True)),
        ("int4 g64", torch.bfloat16, ("int4", 64, True)),
        ("int4 g128", torch.bfloat16, ("int4", 128, True)),
        ("int4 g64, bf16 head", torch.bfloat16, ("int4", 64, False)),
        ("nf4 b64", torch.bfloat16, ("nf4", 64, True)),
    ]
    reference = None
    print(f"  {'weights':22s} {'ppl':>8s} {'vs fp32':>8s} {'bits/quantised param':>21s} {'model MiB':>9s}")
    for name, dtype, quant in variants:
        model = copy.deepcopy(base).to(dtype)
        bits = ""
        if quant is not None:
            scheme, group, head = quant
            try:
                quantize_model(model, scheme, group, include_output=head)
            except ConfigError as err:
                print(f"  {name:22s} n/a: {err}")
                continue
            bits = f"{quantized_bits_per_param(model):.2f}"
        ppl = perplexity(model, batches)
        reference = reference or ppl
        print(
            f"  {name:22s} {ppl:8.3f} {100 * (ppl / reference - 1):+7.2f}% {bits:>21s} "
            f"{model_bytes(model) / 2**20:9.2f}"
        )


# ---- speculative decoding ------------------------------------------------------------------------


def train_draft(target, pack: str, steps: int):
    """A small draft distilled from the target on its training data: cross-entropy against the
    target's next-token distribution (forward KL up to a constant), which is what raises the share of
    proposals the target keeps."""
    from kiln.data.loader import TokenLoader

    cfg = ModelConfig(
        vocab_size=target.cfg.vocab_size, dim=128, n_layers=2, n_heads=2, max_seq_len=target.cfg.max_seq_len
    )
    torch.manual_seed(0)
    draft = build_model(cfg)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3, weight_decay=0.0)
    loader = TokenLoader(pack, "train", seq_len=cfg.max_seq_len, batch_size=8)
    start = time.perf_counter()
    for step in range(steps):
        x, _ = next(loader)
        lr = 3e-3 * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * (1 - step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                teacher = target(x).float().softmax(-1)
            logits = draft(x)
        loss = -(teacher * logits.float().log_softmax(-1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
    x, _ = next(iter(TokenLoader(pack, "val", seq_len=cfg.max_seq_len, batch_size=8).iter_batches(1)))
    with torch.no_grad():
        agree = (draft(x).argmax(-1) == target(x).argmax(-1)).float().mean().item()
    print(
        f"  draft: dim 128, 2 layers ({count_params(cfg) / 1e6:.1f}M params), distilled {steps} steps in "
        f"{time.perf_counter() - start:.0f} s; top-1 agreement with the target on validation text {agree:.2f}"
    )
    return draft.eval()


def speculative(ckpt: str, pack: str, steps: int, new: int, rounds: int, max_others: float) -> None:
    """Greedy identity is checked in fp32; speed is measured with both models in bf16 with prepacked
    weights, the fast configuration (float32 matmuls over the k + 1 tokens of a verification pass cost
    about twice a one-token pass on this CPU, which alone undoes the gain)."""
    from kiln.data.loader import TokenLoader
    from kiln.infer.speculative import SpeculativeEngine

    target, _ = load_checkpoint(ckpt)
    print(f"\nspeculative decoding: target {ckpt} ({count_params(target.cfg) / 1e6:.1f}M params)")
    draft = train_draft(target, pack, steps)
    x, _ = next(iter(TokenLoader(pack, "val", seq_len=32, batch_size=4).iter_batches(1)))
    prompts = x.tolist()
    alone = Engine(target).generate(prompts, new, temperature=0)
    for k in (2, 4):
        spec = SpeculativeEngine(target, draft, k=k)
        outs = spec.generate(prompts, new, temperature=0)
        same = all(o.ids == a.ids for o, a in zip(outs, alone))
        s = spec.stats
        print(
            f"  fp32, k={k}, {len(prompts)} prompts x {new} tokens: greedy output identical to the target alone: "
            f"{'yes' if same else 'NO'}; {s.accepted}/{s.proposed} proposals kept ({s.acceptance_rate:.2f}), "
            f"{1 + k * s.acceptance_rate:.2f} tokens per row per verification pass"
        )
    fast_target = prepack_model(copy.deepcopy(target).to(torch.bfloat16))
    fast_draft = prepack_model(copy.deepcopy(draft).to(torch.bfloat16))
    one = prompts[:1]
    runs = {
        "target alone": lambda n: Engine(fast_target).generate(one, n, temperature=0),
        "draft alone": lambda n: Engine(fast_draft).generate(one, n, temperature=0),
    }
    engines = {}
    for k in (1, 2, 4):
        engines[k] = SpeculativeEngine(fast_target, fast_draft, k=k)
        runs[f"with draft, k={k}"] = (lambda e: lambda n: e.generate(one, n, temperature=0))(engines[k])
    rates, others = decode_rates(
        {n: (lambda f: lambda p, m: f(m))(f) for n, f in runs.items()}, torch.zeros(1, 1), new, rounds
    )
    clean = [b <= max_others for b in others] if any(b <= max_others for b in others) else [True] * len(others)
    base = statistics.median(r for r, ok in zip(rates["target alone"], clean) if ok)
    print(
        f"  bf16 prepacked, batch 1, decode tokens/s (other processes' CPU cores per round: "
        f"{', '.join(f'{b:.2f}' for b in others)})"
    )
    for name, per_round in rates.items():
        med = statistics.median(r for r, ok in zip(per_round, clean) if ok)
        k = int(name.rpartition("=")[2]) if "k=" in name else None
        kept = f"   ({engines[k].stats.acceptance_rate:.2f} of proposals kept)" if k else ""
        print(f"  {name:18s} {med:7.1f} tokens/s  {med / base:5.2f}x{kept}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--n-layers", type=int, default=6)
    parser.add_argument("--n-heads", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--schemes",
        default="int8,int4-g32,int4-g128",
        help="quantised Kiln contenders (int8, int4-g<group>, nf4-g<block>)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; decode runs many small kernels, where a second thread mostly waits",
    )
    parser.add_argument(
        "--max-others",
        type=float,
        default=0.25,
        help="leave out rounds in which other processes kept more CPU cores busy than this",
    )
    parser.add_argument(
        "--skip-compiled", action="store_true", help="leave out Kiln with the compiled decode step (compile_decode)"
    )
    parser.add_argument("--ckpt", default="runs/tiny/pretrain")
    parser.add_argument("--pack", default="runs/tiny/pack")
    parser.add_argument("--ppl-windows", type=int, default=128)
    parser.add_argument("--skip-ppl", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--speculative", action="store_true")
    parser.add_argument("--draft-steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    print(cpu_line())
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} "
        f"threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    if not args.skip_speed:
        cfg = ModelConfig(
            vocab_size=args.vocab,
            dim=args.dim,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            max_seq_len=max(512, args.prompt_len + args.new_tokens),
        )
        torch.manual_seed(0)
        base = build_model(cfg).eval()
        print(
            f"speed model: dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, ffn {cfg.ffn_hidden_size}, "
            f"vocab {cfg.vocab_size}: {count_params(cfg) / 1e6:.1f}M params; prompt {args.prompt_len}, "
            f"{args.new_tokens} new tokens, greedy"
        )
        from kiln.hf import export_hf

        with tempfile.TemporaryDirectory() as export_dir:
            export_hf(cfg, base.state_dict(), None, export_dir)
            runs = contenders(base, Path(export_dir), [s for s in args.schemes.split(",") if s], not args.skip_compiled)
        gen = torch.Generator().manual_seed(1)
        check = torch.randint(0, cfg.vocab_size, (4, args.prompt_len), generator=gen)
        same = runs["kiln fp32"](check, 32) == runs["transformers fp32"](check, 32)
        print(f"greedy tokens, Kiln fp32 vs transformers fp32 (4 prompts x 32): {'identical' if same else 'DIFFER'}")
        summary = {}
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = torch.randint(0, cfg.vocab_size, (batch, args.prompt_len), generator=gen)
            rates, others = decode_rates(runs, prompts, args.new_tokens, args.rounds)
            summary[batch] = report_speed(rates, others, args.max_others, batch)
        print("\nsummary: Kiln / transformers decode tokens/s (same dtype)")
        for batch, med in summary.items():
            kinds = ("fp32", "fp32 prepacked", "bf16", "bf16 prepacked")
            print(
                f"  batch {batch}: "
                + ", ".join(
                    f"{d}{suffix} {med[f'kiln {d}{suffix}'] / med['transformers ' + d.split()[0]]:.2f}x"
                    for suffix in ("", " compiled")
                    for d in kinds
                    if f"kiln {d}{suffix}" in med
                )
                + "".join(
                    f", {s} {med[f'kiln {s}'] / med['transformers bf16']:.2f}x" for s in args.schemes.split(",") if s
                )
            )
    have_ckpt = Path(args.ckpt).exists() and Path(args.pack).exists()
    if not args.skip_ppl:
        if have_ckpt:
            ppl_table(args.ckpt, args.pack, args.ppl_windows)
        else:
            print(
                f"\nperplexity skipped: no checkpoint at {args.ckpt} or no pack at {args.pack} "
                f"(run `kiln run recipes/tiny.toml` first)"
            )
    if args.speculative:
        if have_ckpt:
            speculative(args.ckpt, args.pack, args.draft_steps, args.new_tokens, args.rounds, args.max_others)
        else:
            print("\nspeculative decoding skipped: it needs a trained checkpoint and its pack")
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
