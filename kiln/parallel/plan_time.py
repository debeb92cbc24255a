"""The planner's time model and ranking: for a layout that kiln.parallel.plan accepts and sizes,
estimate the step time and MFU, then rank the layouts that fit.

Pure arithmetic (no torch). Time is compute (matmuls and attention at stated fractions of peak, the
rest at HBM speed), plus the pipeline bubble, the tensor- and expert-parallel collectives, and
whatever data- and context-parallel traffic outlasts the compute it overlaps. Formulas, sources and
the checks against published training runs are in docs/plan.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from kiln.model.config import ModelConfig
from kiln.parallel.hardware import NCCL_BASE_LATENCY, NCCL_STEP_LATENCY, ClusterConfig
from kiln.parallel.optimizer_state import OptimizerState, optimizer_state
from kiln.parallel.plan import (
    KILN,
    ActivationModel,
    Layout,
    Memory,
    Workload,
    attention_flops_per_token,
    candidates,
    deferred_grad_sync,
    layer_activation_bytes,
    layer_params,
    layout_problems,
    memory,
    model_flops_per_token,
    rank_params,
    representative_ranks,
    stage_counts,
)


# ----------------------------------------------------------------------------- time
@dataclass(frozen=True)
class Link:
    """What a collective's ring steps cross: bandwidth (after comm_efficiency) and latency per step."""

    bw: float
    step_latency: float


def _group_link(cluster: ClusterConfig, stride: int, size: int) -> Link:
    """The link of a ring of `size` ranks `stride` apart. The mesh is laid out like torchtitan's
    (pp, dp_replicate, dp_shard, cp, tp) with tp innermost, so a group stays in one node exactly when
    stride * size <= gpus_per_node; otherwise each GPU's own NIC carries its part of the ring."""
    if stride * size <= cluster.gpus_per_node:
        return Link(cluster.intra, NCCL_STEP_LATENCY["intra"])
    return Link(cluster.inter, NCCL_STEP_LATENCY["inter"])


def _ring(n: int, nbytes: float, link: Link, allreduce: bool = False) -> float:
    """All-gather or reduce-scatter of an `nbytes` tensor over n ranks in the alpha-beta model: a
    launch latency, n - 1 ring steps of latency each, and (n - 1)/n * bytes / bandwidth; an
    all-reduce is both halves. An all-to-all moves the same (n - 1)/n share in as many steps."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = (2 if allreduce else 1) * (n - 1)
    return NCCL_BASE_LATENCY + steps * link.step_latency + steps / n * nbytes / link.bw


def _send(nbytes: float, link: Link) -> float:
    """One point-to-point transfer (pipeline stages, ring attention's K/V blocks)."""
    return NCCL_BASE_LATENCY + link.step_latency + nbytes / link.bw


def muon_seconds(
    state: OptimizerState,
    lay: Layout,
    cluster: ClusterConfig,
    work: Workload,
    share: float,
    shard_link: Link,
    tp_link: Link,
    rep_link: Link,
) -> float:
    """What Muon (kiln.train.muon) adds to the optimizer step of a rank whose pipeline stage holds
    `share` of the blocks: the Newton-Schulz iterations of its matrices (bf16 matmuls at the matmul
    efficiency) and, where the matrices are sharded, moving each whole to the rank that
    orthogonalises it and its result back, with nothing to overlap. Whole matrices (DDP) are
    orthogonalised on every rank. FSDP's and HSDP's row shards (no tensor parallelism) go in rounds
    of as many matrices as there are shard ranks, two all-to-alls a round in which each rank sends
    its own shards once; every shard rank orthogonalises one matrix a round, and HSDP's replicas
    each do the same. Under tensor parallelism each matrix is gathered whole to every rank and
    scattered from one owner, turning over the diagonal of its mesh (the smallest of its dimensions:
    HSDP's replicas, FSDP's shards, tp), and HSDP's replicas also take the result by broadcast."""
    flops = state.newton_schulz_flops(work.muon_ns_steps) * share
    if not flops:
        return 0.0
    shards = lay.shard_degree if lay.zero else 1
    replicas = lay.dp_replicate if lay.zero else 1
    dims = [n for n in (replicas, shards, lay.tp) if n > 1]
    rate = cluster.peak_flops * cluster.matmul_efficiency
    if not dims:  # plain tensors: no gathers, and every rank orthogonalises every matrix
        return flops / rate
    matrix_bytes = 4.0 * share * state.muon_params
    matrices = share * sum(count for _, count in state.muon_shapes)
    if lay.tp == 1 and lay.zero:
        if shards == 1:  # replicas of one shard each: every rank orthogonalises every matrix, alone
            return flops / rate
        rounds = math.ceil(matrices / shards)
        # Two all-to-alls a round; a round's buffer is a rank's shards of that round's matrices.
        return flops / shards / rate + 2 * rounds * _ring(shards, matrix_bytes / shards / rounds, shard_link)
    seconds = flops / min(dims) / rate
    link = shard_link if shards > 1 else tp_link
    return seconds + 2 * _ring(shards * lay.tp, matrix_bytes, link) + _ring(replicas, matrix_bytes, rep_link)


@dataclass
class Estimate:
    layout: Layout
    memory: Memory
    fits: bool
    microbatches: int
    step_time: float
    compute_time: float  # busiest pipeline rank: kernels, over the step's micro-batches
    bubble_time: float
    tp_time: float  # tensor- and expert-parallel collectives (exposed)
    cp_time: float  # exposed part only
    pp_time: float
    dp_time: float  # exposed part only
    optimizer_time: float
    mfu: float
    tokens_per_s: float
    # What the data- and context-parallel collectives would take with no overlap at all (dp_time and
    # cp_time are the exposed remainder), so a report never calls a running collective free.
    dp_unoverlapped: float = 0.0
    cp_unoverlapped: float = 0.0


# HBM bytes per attention-score element for unfused (non-flash) attention, bf16 scores and a 1-byte
# dropout mask. Forward: QK^T written (2), fused scale-mask-softmax read and written (4), dropout
# read, written and its mask (5), read by the AV matmul (2). Backward: the probabilities' gradient
# written (2), dropout backward (5), softmax backward reading gradient and output and writing (6),
# read by the two matmuls (4) and the probabilities read for V's gradient (2).
SCORE_BYTES = {True: (13, 19), False: (8, 14)}  # dropout: (forward, backward)


def layer_seconds_per_token(
    cfg: ModelConfig, seq_len: int, cluster: ClusterConfig, ac: str, act: ActivationModel = KILN, moe: bool = False
) -> float:
    """One layer, one token, one GPU (before tensor-parallel division): matmuls and attention kernels
    at their efficiencies, and the memory-bound rest (norms, RoPE, activation functions, residuals,
    casts) as HBM traffic of ~3x the bytes the layer saves (written in forward, read twice in
    backward); without flash attention, the score matrix's passes through HBM (SCORE_BYTES)."""
    peak, hbm = cluster.peak_flops, cluster.spec.hbm_bw
    t_mm = 6.0 * layer_params(cfg, moe, active=True) / (peak * cluster.matmul_efficiency)
    t_attn = attention_flops_per_token(cfg, seq_len) / (peak * cluster.attention_efficiency)
    no_scores = dataclasses.replace(act, flash=True)
    t_mem = 3 * layer_activation_bytes(cfg, seq_len, 1, 1, "none", no_scores, moe) / hbm
    fwd, bwd = (0, 0) if act.flash else SCORE_BYTES[act.dropout]
    t_score_fwd = cfg.n_heads * seq_len * fwd / hbm
    t = t_mm + t_attn + t_mem + cfg.n_heads * seq_len * bwd / hbm + t_score_fwd
    # Recomputation costs time that MFU does not credit: a whole block forward under full
    # checkpointing; under Megatron's selective, the attention core (nothing with flash attention,
    # whose backward recomputes the scores inside the kernel in any case).
    if ac == "selective" and act.op_selective:
        # Kiln's op-level policy (kiln.parallel.parallelize.selective_policy) keeps the outputs of
        # wqkv, w1, w3 and SDPA: backward reruns the output projection wo and the memory-bound ops; in
        # an MoE layer also each routed expert's down projection, whose output the router weights'
        # gradient reads (the shared expert's is only added, so nothing reruns it).
        rerun = cfg.n_heads * cfg.head_dim * cfg.dim
        if moe:
            rerun += cfg.moe_top_k * cfg.dim * cfg.moe_hidden_size
        return t + 2.0 * rerun / (peak * cluster.matmul_efficiency) + t_mem / 3
    recompute = {"full": (t_mm + t_attn + t_mem) / 3 + t_score_fwd, "selective": t_attn / 3 + t_score_fwd}
    return t + (recompute.get(ac, 0.0) if ac != "selective" or not act.flash else 0.0)


def estimate(
    cfg: ModelConfig,
    lay: Layout,
    cluster: ClusterConfig,
    work: Workload,
    act: ActivationModel = KILN,
    state: OptimizerState | None = None,
) -> Estimate:
    """Memory and step time of a layout that layout_problems accepts; `state`, the workload's
    optimizer_state, is passed by plan(), which counts it once for the whole search."""
    counts = stage_counts(cfg, lay)
    state = state or optimizer_state(cfg, work.optimizer)
    mem = memory(cfg, lay, work, act, counts, state)
    m = work.global_seqs // lay.dp // lay.micro_batch
    p, v, s, h = lay.pp, lay.pp_stages_per_rank, work.seq_len, cfg.dim
    tokens = lay.micro_batch * s // lay.cp
    kinds = (False, True) if any(n_moe for _, n_moe in counts) else (False,)
    per_layer = {moe: layer_seconds_per_token(cfg, s, cluster, lay.ac, act, moe) for moe in kinds}
    per_layer.setdefault(True, 0.0)
    # Output head, and the loss's softmax over ~10 bytes per logit, read and written three times.
    t_head = (
        6.0 * cfg.vocab_size * h / (cluster.peak_flops * cluster.matmul_efficiency)
        + 30.0 * cfg.vocab_size / cluster.spec.hbm_bw
    )
    t_attn = attention_flops_per_token(cfg, s) / (cluster.peak_flops * cluster.attention_efficiency)
    act_bytes = tokens * h * 2  # one [tokens, h] bf16 activation, before sequence sharding
    redo = lay.ac == "full"
    kv_bytes = tokens * 2 * cfg.kv_heads * cfg.head_dim * 2 / lay.tp
    intra = _group_link(cluster, 1, 1)
    cp_link = _group_link(cluster, lay.tp, lay.cp)
    ep_link = _group_link(cluster, lay.tp, lay.ep)
    pp_link = _group_link(cluster, lay.tp * lay.cp * lay.dp, p)
    cp_ring = 3 * (lay.cp - 1) * _send(kv_bytes, cp_link)  # one layer's K/V ring traffic, before overlap
    eta = cluster.overlap_efficiency
    slots = {}
    for r in representative_ranks(counts):
        layers, n_moe = counts[r]
        compute = (
            tokens
            * ((layers - n_moe) * per_layer[False] + n_moe * per_layer[True] + (t_head if r == p - 1 else 0.0))
            / lay.tp
        )
        # TP collectives sit between dependent matmuls and are counted in full (no async-TP
        # overlap): sequence parallelism all-gathers and reduce-scatters around attention and MLP,
        # in forward and backward (and again in a recomputed forward).
        comm = layers * (8 + 4 * redo) * _ring(lay.tp, act_bytes, intra)
        # Expert parallelism: dispatch and combine all-to-alls of the k routed copies, fwd and bwd.
        if n_moe and lay.ep > 1:
            comm += n_moe * (4 + 2 * redo) * _ring(lay.ep, act_bytes / lay.tp * cfg.moe_top_k, ep_link)
        # Ring attention passes K/V around the cp ring (fwd) and K/V plus their gradients (bwd),
        # overlapping the layer's attention kernels (at overlap_efficiency) and exposed beyond them.
        cp_t = 0.0 if lay.cp == 1 else layers * (cp_ring - eta * min(cp_ring, tokens * t_attn / lay.tp))
        pp_t = 2 * _send(act_bytes / lay.tp, pp_link) if p > 1 else 0.0
        slots[r] = (compute, comm, cp_t, pp_t)
    busiest = max(slots, key=lambda r: sum(slots[r]))
    compute, tp_t, cp_t, pp_t = slots[busiest]

    dense, experts = rank_params(cfg, lay, *counts[busiest], busiest)
    d, rep = lay.shard_degree, lay.dp_replicate
    shard_bw = _group_link(cluster, lay.tp, lay.dp_shard * lay.cp)
    rep_bw = _group_link(cluster, lay.tp * lay.cp * lay.dp_shard, rep)
    fwd, bwd = compute / 3, compute * 2 / 3
    local = dense / d + experts / max(d // lay.ep, 1) if lay.zero else dense + experts  # after sharding

    def gather(nbytes: float) -> float:  # FSDP traffic: dense over dp_shard*cp, experts over that / ep
        return _ring(d, nbytes * dense, shard_bw) + _ring(d // lay.ep, nbytes * experts, shard_bw)

    # Data-parallel traffic overlaps compute (FSDP prefetch, DDP buckets): what outlasts the compute
    # it can hide behind is exposed, and the overlapped part at 1 - overlap_efficiency. Gradients are reduced in fp32 (Kiln's reduce_dtype).
    per_mb = per_step = 0.0
    unoverlapped = {"mb": 0.0, "step": 0.0}

    def hide(cost: float, behind: float, per: str) -> float:  # the exposed part; the whole is kept
        unoverlapped[per] += cost
        # What outlasts the compute is exposed, and what overlaps it still costs 1 - overlap_efficiency.
        return cost - eta * min(cost, behind)

    if lay.zero == 0:
        ring_bw = rep_bw if rep > 1 else shard_bw
        per_step += hide(_ring(lay.dp * lay.cp, 4 * (dense + experts), ring_bw, True), bwd, "step")
    else:
        rs, ag = gather(4), gather(2)
        # Gradients reduce-scattered every micro-batch, or accumulated unsharded and reduced once.
        rs_mb, rs_step = (0.0, rs) if deferred_grad_sync(lay) else (rs, 0.0)
        if lay.zero == 3:  # gathered for forward and again for backward
            per_mb += hide(ag, fwd, "mb") + hide(ag + rs_mb, bwd, "mb")
            per_step += hide(rs_step, bwd, "step")
        else:  # ZeRO-1/2: gathered once per step
            per_mb += hide(rs_mb, bwd, "mb")
            per_step += hide(rs_step, bwd, "step") + hide(ag, fwd, "step")
        if rep > 1:  # HSDP: all-reduce the gradient shard across the replicas once per step
            per_step += hide(_ring(rep, 4 * local, rep_bw, True), bwd, "step")
    slot = compute + tp_t + cp_t + pp_t + per_mb
    # 1F1B/GPipe idle (p-1) slots per step, a (p-1)/(m+p-1) share; interleaving divides that by v.
    bubble = (p - 1) / v * slot
    # The optimizer reads the fp32 weight and gradient and writes the weight (~16 bytes a parameter,
    # with the update's temporaries), and reads and writes its state: ~32 bytes for Adam's m and v.
    local_experts = experts / max(d // lay.ep, 1) if lay.zero else experts
    state_bytes = (local - local_experts) * state.dense_bytes_per_param + local_experts * state.expert_bytes_per_param
    opt = (16 * local + 2 * state_bytes) / cluster.spec.hbm_bw
    opt += muon_seconds(state, lay, cluster, work, counts[busiest][0] / cfg.n_layers, shard_bw, intra, rep_bw)
    step = m * slot + bubble + per_step + opt
    tokens_step = work.global_seqs * s
    mfu = model_flops_per_token(cfg, s) * tokens_step / (cluster.world * cluster.peak_flops * step)
    return Estimate(
        lay,
        mem,
        mem.total <= cluster.usable_memory,
        m,
        step,
        m * compute,
        bubble,
        m * tp_t,
        m * cp_t,
        m * pp_t,
        m * per_mb + per_step,
        opt,
        mfu,
        tokens_step / step,
        m * unoverlapped["mb"] + unoverlapped["step"],
        m * counts[busiest][0] * cp_ring,
    )


# ----------------------------------------------------------------------------- ranking
@dataclass
class Plan:
    model: ModelConfig
    cluster: ClusterConfig
    work: Workload
    ranked: list[Estimate]  # layouts that fit, fastest first
    too_big: list[Estimate]  # valid layouts that do not fit, smallest first
    rejected: dict[str, int]  # kind of problem -> layouts excluded for it
    # Each excluded layout once, under its first problem, so the counts add up to the layouts excluded.
    invalid: dict[str, int] = dataclasses.field(default_factory=dict)


def plan(
    cfg: ModelConfig, cluster: ClusterConfig, work: Workload, act: ActivationModel = KILN, fixed: dict | None = None
) -> Plan:
    """Estimate every candidate; `fixed` holds Layout fields to keep, e.g. {"tp": 8, "pp": 16}."""
    pool = list(candidates(cfg, cluster, work, act))
    if fixed:
        # Values the search generates select among its candidates; values it never generates (tp
        # beyond a node, ep on a dense model, an odd micro-batch) are forced on, to say why they fail.
        chosen = [lay for lay in pool if all(getattr(lay, k) == v for k, v in fixed.items())]
        pool = chosen or list(dict.fromkeys(dataclasses.replace(lay, **fixed) for lay in pool))
    ranked, too_big, rejected, invalid = [], [], {}, {}
    state = optimizer_state(cfg, work.optimizer)
    for lay in pool:
        problems = layout_problems(cfg, lay, cluster, work)
        for i, reason in enumerate(problems):
            key = re.sub(r"\d+", "N", reason)  # count kinds of problem, not each number
            rejected[key] = rejected.get(key, 0) + 1
            if i == 0:
                invalid[key] = invalid.get(key, 0) + 1
        if not problems:
            est = estimate(cfg, lay, cluster, work, act, state)
            (ranked if est.fits else too_big).append(est)
    # Estimates within 0.5% tie; fewer parallel dimensions win, then the larger micro-batch (bigger
    # matmuls run closer to peak, which the model does not credit), then less memory.
    ranked.sort(key=lambda e: (step_bucket(e), _dims(e.layout), -e.layout.micro_batch, e.memory.total))
    too_big.sort(key=lambda e: e.memory.total)
    return Plan(cfg, cluster, work, ranked, too_big, rejected, invalid)


def step_bucket(est: Estimate) -> int:
    """Estimates in one bucket tie on step time (within 0.5%): the ranking orders them otherwise."""
    return round(math.log(est.step_time) / 0.005)


def _dims(lay: Layout) -> int:
    return sum(d > 1 for d in (lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.cp, lay.ep, lay.pp_stages_per_rank))


def budget(est: Estimate, cluster: ClusterConfig, tokens: float) -> dict:
    """Wall time, GPU-hours, cost and energy to train on `tokens` tokens with this layout. Energy is
    GPU board power at TDP only: no host, network or cooling overhead."""
    seconds = tokens / est.tokens_per_s
    gpu_hours = seconds / 3600 * cluster.world
    return {
        "tokens": tokens,
        "days": seconds / 86400,
        "gpu_hours": gpu_hours,
        "cost_usd": gpu_hours * cluster.gpu_hour_price,
        "energy_mwh": gpu_hours * cluster.spec.power / 1e6,
        "price_per_gpu_hour": cluster.gpu_hour_price,
    }
