"""`kiln plan`: the planner (kiln.parallel.plan) on a recipe's or a preset's model, from the command line.

kiln.pipeline registers the verb with add_plan_parser(subparsers) and runs it with run_plan(args, recipe):
a recipe is read in the top layer, which hands this module the recipe's model and workload.
"""

from __future__ import annotations

import dataclasses
import json
import math

from kiln.config import finite_float
from kiln.errors import ConfigError
from kiln.model.config import PRESETS, ModelConfig, preset
from kiln.parallel.config import ParallelConfig
from kiln.parallel.hardware import GB, GPUS, ClusterConfig
from kiln.parallel.optimizer_state import OPTIMIZERS
from kiln.parallel.plan import (
    KILN,
    MEGATRON,
    Layout,
    Workload,
    total_params,
)
from kiln.parallel.plan_time import (
    Estimate,
    Plan,
    budget,
    plan,
    step_bucket,
)

# Shapes the planner is checked against (docs/plan.md); planning-only, so not training presets.
REFERENCE_MODELS: dict[str, ModelConfig] = {
    # Llama 3 405B (Llama 3 paper, Table 3).
    "405b": ModelConfig(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_hidden=53248,
        vocab_size=128256,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # GPT-3 175B as Megatron-LM benchmarks it (Korthikanti et al. 2022): GELU MLP, LayerNorm, learned
    # positions, a 51200-token vocabulary.
    "gpt3-175b": ModelConfig(
        dim=12288,
        n_layers=96,
        n_heads=96,
        ffn="gelu",
        norm="layernorm",
        pos="learned",
        vocab_size=51200,
        max_seq_len=2048,
        tie_embeddings=True,
        qkv_bias=True,
    ),
}
# Kiln presets leave vocab_size to the tokenizer; planning one needs a number: the published model's.
DEFAULT_VOCAB = {"tiny": 8192, "tiny-moe": 8192, "125m": 50257, "1b": 128256, "8b": 128256, "70b": 128256}


def add_plan_parser(verbs) -> None:
    p = verbs.add_parser("plan", help="estimate memory, step time, MFU and cost of parallel layouts on a cluster")
    p.add_argument("recipe", nargs="?", help="TOML recipe: the model from [model], seq_len and batch from [train]")
    p.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. model.n_layers=48")
    p.add_argument("--preset", help=f"plan a preset instead: one of Kiln's, or {', '.join(REFERENCE_MODELS)}")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size when the model leaves it to the tokenizer")
    p.add_argument("--gpu", default="h100", help=" | ".join(GPUS))
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=0, help="default: the recipe's train.seq_len, else max_seq_len")
    p.add_argument("--global-batch-tokens", type=int, default=0, help="default: the recipe's, else 4Mi tokens")
    p.add_argument(
        "--optimizer", default="", help=f"{' | '.join(OPTIMIZERS)} (default: the recipe's train.optimizer, else adamw)"
    )
    p.add_argument("--tokens", type=finite_float, default=0.0, help="token budget to price, e.g. 15e12")
    p.add_argument("--top", type=int, default=10, help="rows of the ranking to print")
    p.add_argument("--layout", help="fix some choices and search the rest, e.g. tp=8,pp=16,cp=1,ac=full")
    p.add_argument("--price", type=finite_float, default=0.0, help="USD per GPU-hour (default: the GPU table's)")
    p.add_argument("--intra-bw", type=finite_float, default=0.0, help="GB/s per GPU within a node (default: the GPU's)")
    p.add_argument("--inter-bw", type=finite_float, default=0.0, help="GB/s per GPU across nodes (default: the GPU's)")
    p.add_argument(
        "--matmul-efficiency",
        type=finite_float,
        default=0.0,
        help="share of the bf16 peak matmuls reach (0: the GPU's)",
    )
    p.add_argument("--attention-efficiency", type=finite_float, default=0.5, help="share of the peak attention reaches")
    p.add_argument(
        "--activations",
        choices=("kiln", "megatron"),
        default="kiln",
        help="what autograd keeps: Kiln's model under PyTorch, or Megatron-LM's GPT (docs/plan.md)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def parse_layout(text: str) -> dict:
    """`tp=8,pp=16,ac=full` -> {"tp": 8, "pp": 16, "ac": "full"}: Layout fields to hold fixed."""
    kinds = {f.name: f.type for f in dataclasses.fields(Layout)}
    fixed: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in kinds:
            raise ConfigError("layout", f"expected key=value with key one of {', '.join(kinds)}, got {item!r}")
        try:
            fixed[key] = value if kinds[key] == "str" else int(value)
        except ValueError:
            raise ConfigError(f"layout.{key}", f"must be an integer, got {value!r}") from None
    return fixed


def model_and_workload(args, recipe: tuple[ModelConfig, Workload] | None = None) -> tuple[ModelConfig, Workload]:
    """What to plan: `recipe`, the model and workload of the recipe args.recipe names (read by the caller),
    else the --preset's model; --vocab, --seq-len, --global-batch-tokens and --optimizer override either."""
    if args.recipe and recipe is None:
        raise TypeError("args.recipe is read by the caller (kiln.pipeline), which passes its model and workload")
    if recipe is not None:
        cfg, work = recipe
        vocab = args.vocab or cfg.vocab_size
        seq = args.seq_len or work.seq_len
        batch = args.global_batch_tokens or work.global_batch_tokens
        optimizer, ns_steps = args.optimizer or work.optimizer, work.muon_ns_steps
    elif args.preset:
        if args.preset not in PRESETS and args.preset not in REFERENCE_MODELS:
            known = ", ".join([*PRESETS, *REFERENCE_MODELS])
            raise ConfigError("preset", f"unknown preset {args.preset!r}; known: {known}")
        cfg = REFERENCE_MODELS.get(args.preset) or preset(args.preset)
        vocab = args.vocab or cfg.vocab_size or DEFAULT_VOCAB.get(args.preset, 0)
        seq, batch = args.seq_len or cfg.max_seq_len, args.global_batch_tokens or 4 * 1024 * 1024
        optimizer, ns_steps = args.optimizer or "adamw", Workload.muon_ns_steps
    else:
        raise ConfigError("recipe", "give a recipe path or --preset NAME")
    if vocab <= 0:
        raise ConfigError("vocab_size", "unknown; pass --vocab")
    cfg = dataclasses.replace(cfg, vocab_size=vocab)
    cfg.validate()
    for key, value in (("seq_len", seq), ("global_batch_tokens", batch)):
        if value <= 0:
            raise ConfigError(key, f"must be positive, got {value}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError("--optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    return cfg, Workload(seq, batch, optimizer, ns_steps)


def unique_layouts(ests: list[Estimate]) -> list[Estimate]:
    """The first estimate per mesh shape, so a ranking is not ten micro-batch sizes of one mesh."""
    seen, out = set(), []
    for e in ests:
        key = (e.layout.dp_replicate, e.layout.dp_shard, e.layout.tp, e.layout.pp, e.layout.cp, e.layout.ep)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


# The [train] keys a layout decides; Kiln's TrainConfig (kiln/train/config.py, a layer above) names them.
TRAIN_KEYS = ("seq_len", "global_batch_tokens", "micro_batch_size", "activation_checkpointing")
# What each optimizer keeps (kiln.parallel.optimizer_state), in the optimizer line of the memory terms.
OPTIMIZER_STATE_NAMES = {
    "adamw": "Adam m and v",
    "lion": "Lion's momentum",
    "adafactor": "Adafactor's factored second moments",
    "muon": "Muon's momentum for the block matrices, Adam m and v for the rest",
}
MEMORY_TERMS = {
    "params": "weights",
    "grads": "gradients",
    "optimizer": "optimizer states (fp32 master weights, {state})",
    "activations": "activations autograd keeps, times the micro-batches in flight",
    "logits": "logits, their fp32 copy and gradient (last pipeline rank)",
    "buffers": "FSDP working set (gathered blocks, unreduced gradients); zero=0: autocast's 16-bit weight copies",
}


def recipe_tables(e: Estimate, work: Workload) -> dict[str, dict]:
    """The [parallel] and [train] tables that run `e`: the mesh degrees and the [parallel] keys that
    differ from their defaults, and every [train] key the layout decides (a recipe may set any of them).
    Under a pipeline, train.micro_batch_size is the replica's whole batch, which the schedule splits
    into pp_microbatches micro-batches; otherwise the rest of the batch is gradient accumulation."""
    cfg, default = e.layout.to_parallel_config(e.microbatches), ParallelConfig()
    degrees = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
    parallel = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.name in degrees or getattr(cfg, f.name) != getattr(default, f.name)
    }
    batch = e.layout.micro_batch * (e.microbatches if e.layout.pp > 1 else 1)
    train = dict(zip(TRAIN_KEYS, (work.seq_len, work.global_batch_tokens, batch, e.layout.ac)))
    if work.optimizer != Workload.optimizer:  # the plan's memory and time are this optimizer's
        train["optimizer"] = work.optimizer
    return {"parallel": parallel, "train": train}


def toml_text(tables: dict[str, dict]) -> str:
    def value(v) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v)

    return "\n\n".join(
        f"[{name}]\n" + "\n".join(f"{k} = {value(v)}" for k, v in t.items()) for name, t in tables.items()
    )


def memory_terms_gb(e: Estimate) -> tuple[dict[str, float], float]:
    """Each memory term in GB at 2 decimals, rounded (largest remainder) so the terms add up to the
    total printed; each term is within 0.01 GB of its own value."""
    raw = {f.name: getattr(e.memory, f.name) / GB * 100 for f in dataclasses.fields(e.memory) if f.name != "rank"}
    total = round(sum(raw.values()))
    cents = {k: math.floor(v) for k, v in raw.items()}
    for k in sorted(raw, key=lambda k: cents[k] - raw[k])[: max(0, total - sum(cents.values()))]:
        cents[k] += 1
    return {k: c / 100 for k, c in cents.items()}, total / 100


def comm_seconds(e: Estimate) -> tuple[float, float]:
    """(all collective time per step with no overlap, the exposed part that the step time includes).
    TP, EP and pipeline transfers are counted in full; data- and context-parallel traffic overlaps
    compute up to what it can, and the overlapped part still costs 1 - overlap_efficiency."""
    whole = e.tp_time + e.pp_time + e.cp_unoverlapped + e.dp_unoverlapped
    return whole, e.tp_time + e.pp_time + e.cp_time + e.dp_time


def share(part: float, step: float) -> str:
    """A share of the step; never a 0.0% for time that is there."""
    return "0" if part <= 0 else ("<0.1%" if part / step < 0.0005 else f"{part / step:.1%}")


def comm_cells(e: Estimate) -> tuple[str, str]:
    whole, exposed = comm_seconds(e)
    return share(whole, e.step_time), ("hidden" if whole > 0 and exposed <= 0 else share(exposed, e.step_time))


def tie_lines(rows: list[Estimate], work: Workload) -> list[str]:
    """Why consecutive rows of the ranking tie, and what then ordered them."""
    out, start = [], 0
    for i in range(1, len(rows) + 1):
        if i < len(rows) and step_bucket(rows[i]) == step_bucket(rows[start]):
            continue
        group = rows[start:i]
        if len(group) > 1:
            fields = [f.name for f in dataclasses.fields(Layout)]
            differ = [k for k in fields if len({getattr(e.layout, k) for e in group}) > 1]
            tokens = {e.layout.micro_batch * work.seq_len // e.layout.cp for e in group}
            hidden = sorted(comm_seconds(e)[0] - comm_seconds(e)[1] for e in group)
            why = []
            if len(tokens) == 1:
                why.append(
                    f"each GPU computes the same {tokens.pop():,} tokens per micro-batch (micro_batch x seq_len / cp)"
                )
            if hidden[-1] > 0:
                span = f"{hidden[0]:.2f}-{hidden[-1]:.2f}" if hidden[-1] - hidden[0] >= 0.005 else f"{hidden[0]:.2f}"
                why.append(
                    f"their data- and context-parallel traffic ({span} s per step) is assumed hidden behind compute"
                )
            out.append(
                f"rows {start + 1}-{i} tie (step times within 0.5%): they differ only in {', '.join(differ)}"
                + (f"; {' and '.join(why)}" if why else "")
                + ". The model prices no difference between them; the order is fewer parallel dimensions, "
                "then the larger micro-batch, then less memory."
            )
        start = i
    return out


def pruned_counts(result: Plan) -> list[tuple[str, int]]:
    """Every layout the search left out, counted once under one reason (invalid ones under their
    first problem, the rest under the largest memory term), most frequent first."""
    too_big: dict[str, int] = {}
    for e in result.too_big:
        terms, _ = memory_terms_gb(e)
        key = f"does not fit in {result.cluster.usable_memory / GB:.1f} GB (largest term: {max(terms, key=terms.get)})"
        too_big[key] = too_big.get(key, 0) + 1
    return sorted((too_big | result.invalid).items(), key=lambda kv: -kv[1])


def pruned_lines(result: Plan) -> list[str]:
    reasons = pruned_counts(result)
    pruned = sum(n for _, n in reasons)
    out = [f"searched {len(result.ranked) + pruned} layouts: {len(result.ranked)} fit, {pruned} pruned"]
    return out + [f"  {n:>7}  {reason}" for reason, n in reasons]


def caveat_lines(e: Estimate, cluster: ClusterConfig) -> list[str]:
    out = [
        f"caveats: MFU assumes matmuls at {cluster.matmul_efficiency:.0%} and attention at "
        f"{cluster.attention_efficiency:.0%} of peak (calibrated on published runs, docs/plan.md; pass measured "
        "values with --matmul-efficiency / --attention-efficiency); small models lose more to launch overheads "
        "than modelled."
    ]
    whole, exposed = comm_seconds(e)
    lay = e.layout
    if whole > exposed:
        out.append(
            f"  {whole - exposed:.2f} s of data-/context-parallel traffic per step is assumed to overlap compute "
            f"(FSDP prefetch, DDP buckets, ring attention) at overlap_efficiency {cluster.overlap_efficiency}; "
            "if it does not, add it to the step."
        )
    out.append(
        "  not modelled: the loss and gradient-norm all-reduces"
        + (", loss parallelism's reductions over the vocabulary" if lay.tp > 1 else "")
        + "."
    )
    if lay.ac == "selective":
        out.append(
            '  ac=selective runs as train.activation_checkpointing = "selective", Kiln\'s op-level policy (matmul and'
            " attention outputs kept); --activations megatron counts Megatron's selective recomputation instead."
        )
    return out


def row(e: Estimate, cluster: ClusterConfig) -> dict:
    times = ("compute_time", "bubble_time", "tp_time", "cp_time", "pp_time", "dp_time", "optimizer_time")
    times += ("cp_unoverlapped", "dp_unoverlapped")
    return {
        "layout": e.layout.label(),
        **dataclasses.asdict(e.layout),
        "microbatches": e.microbatches,
        "fits": e.fits,
        "memory_gb": e.memory.as_gb(),
        "usable_gb": round(cluster.usable_memory / GB, 2),
        "step_time_s": e.step_time,
        "tokens_per_s": e.tokens_per_s,
        "mfu": e.mfu,
        "seconds": {k: getattr(e, k) for k in times},
    }


def report(result: Plan, top: int, cost: dict | None) -> list[str]:
    cluster, out = result.cluster, []
    rows = unique_layouts(result.ranked)[:top]
    if rows:
        out.append(
            f"{len(result.ranked)} layouts fit; the best per mesh (comm: all collective time as a share of the "
            "step if nothing overlapped; exposed: the part the step time includes):"
        )
        out.append(
            f"{'#':>3}  {'layout':<64} {'GB/GPU':>7} {'step':>8} {'tok/s/GPU':>10} {'MFU':>6} {'bubble':>7} "
            f"{'comm':>6} {'exposed':>7}"
        )
        for i, e in enumerate(rows, 1):
            step = f"{e.step_time * 1e3:.0f} ms" if e.step_time < 1 else f"{e.step_time:.2f} s"
            comm, exposed = comm_cells(e)
            out.append(
                f"{i:>3}  {e.layout.label():<64} {memory_terms_gb(e)[1]:>7.1f} {step:>8} "
                f"{e.tokens_per_s / cluster.world:>10,.0f} {e.mfu:>6.1%} "
                f"{e.bubble_time / e.step_time:>7.1%} {comm:>6} {exposed:>7}"
            )
        out += tie_lines(rows, result.work)
    shown = result.ranked[:1] or result.too_big[:1]
    for e in shown:
        terms, total = memory_terms_gb(e)
        out.append(f"{'best' if e.fits else 'no layout fits; closest'}: {e.layout.label()}")
        out.append(
            f"  memory per GPU (pipeline rank {e.memory.rank}): {total:.2f} GB "
            f"{'fits' if e.fits else 'does NOT fit'} in {cluster.usable_memory / GB:.1f} GB usable"
        )
        state = OPTIMIZER_STATE_NAMES[result.work.optimizer]
        out += [
            f"    {k:<12}{v:>8.2f} GB  {MEMORY_TERMS.get(k, '').format(state=state)}".rstrip() for k, v in terms.items()
        ]
        whole, exposed = comm_seconds(e)
        out.append(
            f"  step {e.step_time:.3f} s = compute {e.compute_time:.3f} + bubble {e.bubble_time:.3f} + exposed "
            f"communication {exposed:.3f} (of {whole:.3f} s unoverlapped) + optimizer {e.optimizer_time:.3f}"
        )
        if e.fits:
            out.append("  to run it, set these keys in the recipe ([parallel] and [train] tables):")
            if e.layout.zero == 1:
                out.append("# zero=1: gradients reduced on the last micro-batch only (Kiln's gradient accumulation)")
            out += toml_text(recipe_tables(e, result.work)).splitlines()
        out += caveat_lines(e, cluster)
    if not shown:
        out.append("no valid layout")
    if cost:
        out.append(
            f"budget {cost['tokens']:.3g} tokens: {cost['days']:.1f} days, {cost['gpu_hours']:,.0f} GPU-hours, "
            f"${cost['cost_usd']:,.0f} at ${cost['price_per_gpu_hour']:.2f}/GPU-hour, "
            f"{cost['energy_mwh']:,.1f} MWh (GPU TDP only)"
        )
    return out + pruned_lines(result)


def run_plan(args, recipe: tuple[ModelConfig, Workload] | None = None) -> int:
    """Prints the ranking (or JSON with --json); exit status 1 when no layout fits. `recipe`: the model
    (vocab_size resolved) and workload of args.recipe, see model_and_workload."""
    if args.tokens < 0:
        raise ConfigError("--tokens", f"must be >= 0 (0: no budget to price), got {args.tokens:g}")
    cfg, work = model_and_workload(args, recipe)
    cluster = ClusterConfig(
        gpu=args.gpu,
        gpus_per_node=args.gpus_per_node,
        n_nodes=args.nodes,
        intra_bw=args.intra_bw * GB,
        inter_bw=args.inter_bw * GB,
        price=args.price,
        matmul_efficiency=args.matmul_efficiency,
        attention_efficiency=args.attention_efficiency,
    )
    act = MEGATRON if args.activations == "megatron" else KILN
    result = plan(cfg, cluster, work, act, fixed=parse_layout(args.layout) if args.layout else None)
    best = result.ranked[0] if result.ranked else None
    cost = budget(best, cluster, args.tokens) if best and args.tokens else None
    if args.json:
        print(
            json.dumps(
                {
                    "model_params": total_params(cfg),
                    "world": cluster.world,
                    "seq_len": work.seq_len,
                    "global_batch_tokens": work.global_batch_tokens,
                    "optimizer": work.optimizer,
                    "ranked": [row(e, cluster) for e in unique_layouts(result.ranked)[: args.top]],
                    "closest_not_fitting": [row(e, cluster) for e in result.too_big[:1]],
                    "rejected": result.rejected,
                    "pruned": dict(pruned_counts(result)),
                    "recipe_tables": recipe_tables(best, work) if best else None,
                    "budget": cost,
                },
                indent=1,
            )
        )
    else:
        print(
            f"model: {total_params(cfg) / 1e9:.3g}B parameters ({cfg.n_layers} layers, dim {cfg.dim}, "
            f"{cfg.n_heads}/{cfg.kv_heads} heads, vocab {cfg.vocab_size}); seq_len {work.seq_len}, "
            f"{work.global_batch_tokens:,} tokens per step, optimizer {work.optimizer}"
        )
        print(f"cluster: {cluster.describe()}")
        print("\n".join(report(result, args.top, cost)))
    return 0 if best else 1
