"""The training-cluster planner behind `kiln plan`: for a model, a cluster, a sequence length and a
global batch, the parallel layouts to consider, why a layout cannot run, and each layout's per-GPU
memory. Step time, MFU and the ranking are kiln.parallel.plan_time.

Pure arithmetic (no torch). Formulas, sources and the checks against published training runs are in
docs/plan.md; in short:
- model states follow the ZeRO paper (Rajbhandari et al. 2019): mixed-precision Adam keeps
  2 + 2 + 12 = 16 bytes per parameter, partitioned over the data-parallel shards stage by stage;
- activations are counted tensor by tensor as Korthikanti et al. 2022 do; for a GPT-3 layer with
  dropout and materialised attention scores the count is their s*b*h*(34 + 5*a*s/h).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass

from kiln.errors import ConfigError
from kiln.model.config import AC_MODES, ModelConfig
from kiln.parallel.config import PP_SCHEDULES, ParallelConfig
from kiln.parallel.hardware import GB, ClusterConfig
from kiln.parallel.optimizer_state import OptimizerState, optimizer_state


# ----------------------------------------------------------------------------- model accounting
def is_moe(cfg: ModelConfig, layer: int) -> bool:
    check = getattr(cfg, "is_moe_layer", None)  # the MoE fields of ModelConfig
    return bool(check and check(layer))


def moe_layer_count(cfg: ModelConfig) -> int:
    return sum(is_moe(cfg, i) for i in range(cfg.n_layers))


def layer_params(cfg: ModelConfig, moe: bool = False, active: bool = False) -> int:
    """Parameters of one block, as kiln.model.transformer.count_params counts them. For an MoE block
    `active` keeps only the moe_top_k experts a token runs through (the ones that cost FLOPs)."""
    h = cfg.dim
    qkv = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim
    attn = h * qkv + (qkv if cfg.qkv_bias else 0) + cfg.n_heads * cfg.head_dim * h
    attn += 2 * cfg.head_dim if cfg.qk_norm else 0  # the q and k norm weights
    norms = 2 * (h if cfg.norm == "rmsnorm" else 2 * h)
    if not moe:
        return attn + norms + (3 if cfg.ffn == "swiglu" else 2) * h * cfg.ffn_hidden_size
    experts = cfg.moe_top_k if active else cfg.n_experts
    return attn + norms + h * cfg.n_experts + (experts + cfg.moe_shared_expert) * 3 * h * cfg.moe_hidden_size


def routed_expert_params(cfg: ModelConfig) -> int:
    """The routed experts of one MoE block: the part that expert parallelism splits."""
    return cfg.n_experts * 3 * cfg.dim * cfg.moe_hidden_size


def embedding_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.dim + (cfg.max_seq_len * cfg.dim if cfg.pos == "learned" else 0)


def total_params(cfg: ModelConfig) -> int:
    norm = cfg.dim if cfg.norm == "rmsnorm" else 2 * cfg.dim
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    n_moe = moe_layer_count(cfg)
    layers = (cfg.n_layers - n_moe) * layer_params(cfg) + (n_moe * layer_params(cfg, True) if n_moe else 0)
    return layers + norm + embedding_params(cfg) + head


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs of one layer's score and value matmuls (PaLM appendix B convention)."""
    return 12.0 * cfg.n_heads * cfg.head_dim * seq_len


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """kiln.model.transformer.flops_per_token's convention, so a planned MFU is the MFU the trainer
    reports: 6 x (active non-embedding parameters + output head) + the attention matmuls."""
    norm = cfg.dim if cfg.norm == "rmsnorm" else 2 * cfg.dim
    n_moe = moe_layer_count(cfg)
    n = (cfg.n_layers - n_moe) * layer_params(cfg) + (n_moe * layer_params(cfg, True, active=True) if n_moe else 0)
    return 6.0 * (n + norm + cfg.vocab_size * cfg.dim) + cfg.n_layers * attention_flops_per_token(cfg, seq_len)


# ----------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """One candidate: ParallelConfig's mesh degrees plus what the planner also chooses."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    # What data parallelism shards (ZeRO stages) and how Kiln's FSDP2 does it: 0 nothing (DDP);
    # 1 optimizer states (FSDP, reshard off, grad_sync = "deferred": full gradients accumulate and are
    # reduce-scattered on the last micro-batch); 2 + gradients (FSDP, reshard off, reduce-scattered
    # every micro-batch); 3 + parameters (FSDP default). See deferred_grad_sync for pipelining.
    zero: int = 0
    ac: str = "none"  # activation checkpointing: none | selective | full
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard_degree(self) -> int:
        # FSDP shards over dp_shard x cp: the context-parallel ranks hold the same weights.
        return self.dp_shard * self.cp if self.zero else 1

    def label(self) -> str:
        dp = f"{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 and self.dp_shard > 1 else str(self.dp)
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        sched = (
            ""
            if self.pp == 1
            else f" {self.pp_schedule}" + (f"/v{self.pp_stages_per_rank}" if self.pp_stages_per_rank > 1 else "")
        )
        return (
            f"dp={dp} tp={self.tp} pp={self.pp} cp={self.cp}{ep} zero={self.zero} ac={self.ac} "
            f"mb={self.micro_batch}{sched}"
        )

    def to_parallel_config(self, microbatches: int) -> ParallelConfig:
        return ParallelConfig(
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            ep=self.ep,
            # ZeRO-1/2 keep the gathered weights until backward; DDP (zero 0) leaves the key at its default.
            reshard_after_forward=self.zero not in (1, 2),
            # Under pp > 1 the pipeline schedule defers the reduction itself and the key is refused.
            grad_sync="deferred" if self.zero == 1 and self.pp == 1 else "per_microbatch",
            pp_schedule=self.pp_schedule,
            pp_microbatches=microbatches if self.pp > 1 else 0,
            pp_stages_per_rank=self.pp_stages_per_rank,
        )


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch_tokens: int
    optimizer: str = "adamw"  # train.optimizer: its state's bytes and its step's time
    muon_ns_steps: int = 5  # train.muon_ns_steps: Newton-Schulz iterations of a Muon step

    @property
    def global_seqs(self) -> int:
        return self.global_batch_tokens // self.seq_len


def layout_problems(cfg: ModelConfig, lay: Layout, cluster: ClusterConfig, work: Workload) -> list[str]:
    """Why a layout cannot run at all (empty when it can); memory is judged separately."""
    out = []
    if lay.world != cluster.world:
        out.append(f"dp_replicate*dp_shard*tp*pp*cp = {lay.world}, not the world size {cluster.world}")
    if lay.tp > cluster.gpus_per_node:
        out.append(f"tp={lay.tp} exceeds gpus_per_node={cluster.gpus_per_node} (tensor parallelism stays in a node)")
    for name, value in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads), ("ffn_hidden", cfg.ffn_hidden_size)):
        if value % lay.tp:
            out.append(f"tp={lay.tp} does not divide {name}={value}")
    if lay.tp > 1 and cfg.qk_norm:
        out.append(f"tp={lay.tp}: the trainer refuses tensor parallelism with qk_norm")
    if lay.pp * lay.pp_stages_per_rank > cfg.n_layers:
        out.append(f"pp*pp_stages_per_rank={lay.pp * lay.pp_stages_per_rank} exceeds n_layers={cfg.n_layers}")
    if lay.pp_schedule not in PP_SCHEDULES:
        out.append(f"pp_schedule {lay.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
    if lay.pp_stages_per_rank > 1 and lay.pp_schedule != "interleaved_1f1b":
        out.append("pp_stages_per_rank > 1 needs pp_schedule=interleaved_1f1b")
    if lay.cp > 1 and work.seq_len % (2 * lay.cp):
        out.append(f"cp={lay.cp}: seq_len={work.seq_len} must split into 2*cp equal chunks (load-balanced causal)")
    if lay.ep > 1 and not moe_layer_count(cfg):
        out.append(f"ep={lay.ep}: the model is dense (no experts to place)")
    elif lay.ep > 1 and (cfg.n_experts % lay.ep or (lay.dp_shard * lay.cp) % lay.ep):
        out.append(f"ep={lay.ep} must divide n_experts={cfg.n_experts} and dp_shard*cp={lay.dp_shard * lay.cp}")
    if lay.ac not in AC_MODES:
        out.append(f"ac {lay.ac!r} is not one of {', '.join(AC_MODES)}")
    if lay.zero not in (0, 1, 2, 3):
        out.append(f"zero={lay.zero} is not 0, 1, 2 or 3")
    elif lay.zero == 2 and lay.pp > 1:
        out.append("zero=2 under pp > 1 runs as zero=1: the pipeline schedule accumulates full gradients")
    elif lay.zero == 1 and lay.pp == 1 and work.global_seqs == lay.dp * lay.micro_batch:
        out.append("zero=1 with one micro-batch per step runs as zero=2: its only backward reduce-scatters")
    elif lay.zero == 0 and lay.dp_shard > 1:
        out.append("zero=0 replicates (DDP): dp_shard must be 1")
    elif lay.zero > 0 and lay.dp_shard * lay.cp == 1:
        out.append(f"zero={lay.zero} needs dp_shard*cp > 1 to shard over")
    if work.global_batch_tokens % work.seq_len:
        out.append(f"global_batch_tokens={work.global_batch_tokens} is not a multiple of seq_len={work.seq_len}")
    elif work.global_seqs % lay.dp or (work.global_seqs // lay.dp) % lay.micro_batch:
        out.append(
            f"{work.global_seqs} sequences per step do not split into dp={lay.dp} x micro_batch={lay.micro_batch}"
        )
    elif lay.pp > 1:
        m = work.global_seqs // lay.dp // lay.micro_batch
        if m < lay.pp:
            out.append(f"{m} microbatches < pp={lay.pp}: the pipeline would never fill")
        elif lay.pp_schedule == "interleaved_1f1b" and m % lay.pp:
            out.append(f"interleaved_1f1b needs microbatches ({m}) divisible by pp={lay.pp}")
    if not out:
        out += trainer_refusals(lay)
    return out


def trainer_refusals(lay: Layout) -> list[str]:
    """What ParallelConfig refuses in the layout's [parallel] table, so no ranked layout prints a
    table that `kiln launch` or the trainer would reject."""
    try:
        lay.to_parallel_config(0).check_options(lay.dp_shard, None)
    except ConfigError as err:
        return [f"[parallel] {err.key}: " + re.sub(r" \(the layout [^)]*\)", "", err.message)]
    return []


def stage_layer_ids(cfg: ModelConfig, pp: int, v: int = 1) -> list[list[int]]:
    """Layer ids held by each pipeline rank (virtual stage c lives on rank c % pp): the split the
    trainer makes (kiln.parallel.pipeline.split_layers, with the output head weighed by its FLOPs),
    so the memory predicted per rank is that of the layers the rank will really hold."""
    from kiln.parallel.pipeline import head_weight_from_flops, split_layers  # torch, only when pp > 1

    if pp * v == 1:
        return [list(range(cfg.n_layers))]
    return [list(ids) for ids in _rank_layer_ids(split_layers, cfg.n_layers, pp, v, head_weight_from_flops(cfg))]


@functools.lru_cache(maxsize=1024)
def _rank_layer_ids(split_layers, n_layers: int, pp: int, v: int, head_weight: float) -> tuple[tuple[int, ...], ...]:
    """Cached: a search asks for the same few splits once per candidate layout (thousands of times
    for a 405B model, where the split alone was half of `kiln plan`'s search time). `split_layers`
    comes from the caller's one torch-importing import."""
    ids = [[] for _ in range(pp)]
    for c, layers in enumerate(split_layers(n_layers, pp * v, 0.0, head_weight)):
        ids[c % pp].extend(layers)
    return tuple(tuple(i) for i in ids)


# ----------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class ActivationModel:
    """Which tensors autograd keeps per layer. KILN is Kiln's model under PyTorch: SDPA (flash)
    attention, no dropout, PyTorch sequence parallelism, whose column-parallel linears save their
    all-gathered input, float32 statistics (RMSNorm's 1/rms, SDPA's logsumexp), a float32 residual
    stream (autocast over float32 weights; FSDP's bf16 weights make it bf16, see `memory`), and
    op-level selective checkpointing (kiln.parallel.parallelize.selective_policy). MEGATRON is
    Korthikanti et al.'s GPT-3: materialised attention scores, dropout, sequence-sharded saved inputs,
    no statistics counted, a 16-bit residual stream, and selective recomputation of the attention core."""

    flash: bool = True
    dropout: bool = False
    sp_gathered_inputs: bool = True
    # Without FSDP (zero=0) the weights stay fp32 under autocast: a 16-bit copy of each matmul weight
    # lives through the micro-batch. (FSDP2 gathers bf16 weights; Megatron keeps bf16 weights.)
    fp32_weights_unsharded: bool = True
    statistics: bool = True
    residual_bytes: int = 4
    op_selective: bool = True


KILN = ActivationModel()
MEGATRON = ActivationModel(
    flash=False,
    dropout=True,
    sp_gathered_inputs=False,
    statistics=False,
    residual_bytes=2,
    op_selective=False,
    fp32_weights_unsharded=False,
)


def layer_activation_bytes(
    cfg: ModelConfig,
    seq_len: int,
    tokens: int,
    tp: int = 1,
    ac: str = "none",
    act: ActivationModel = KILN,
    moe: bool = False,
    residual_bytes: int | None = None,
) -> float:
    """Bytes one layer keeps for backward for `tokens` tokens (16-bit activations, 1-byte masks).

    Per token: each norm's input 2h; q 2h, k and v 2h*kv_heads/n_heads each; the attention output
    2h (the output projection's input); the inputs of the qkv and first MLP matmuls 2h each; the MLP
    inside (GELU: 2f before and 2f after the activation; SwiGLU: the gate and up outputs 4f, silu(gate)
    2f and the product 2f); with dropout a 1-byte mask after attention and after the MLP; without
    flash attention the scores, a*s*(2 softmax [+ 1 mask + 2 dropout output]). A GPT-3 layer sums to
    h*(34 + 5*a*s/h). Sequence parallelism divides it all by tp, but for the all-gathered matmul
    inputs that PyTorch keeps (ActivationModel.sp_gathered_inputs). An MoE layer (Kiln's eager
    MoEFeedForward) keeps instead of the MLP: its input 2h and float32 copy 4h, router logits and
    probabilities 8E, per routed copy the gathered input 2h, the SwiGLU 8*hm and the output 2h, and
    the shared expert's 8*hm; all sequence-sharded. With act.statistics, 4 bytes per norm (1/rms) and
    4 per head (the logsumexp) more. Full checkpointing keeps the block input, residual_bytes*h
    (act.residual_bytes unless given); Kiln's selective (act.op_selective) the block input, the qkv
    output 2h + 4h*kv/a, the attention output 2h and logsumexp 4a, the up projection's output (SwiGLU
    4f, GELU 2f) and under TP the two reduce-scattered branch outputs 2h each; in an MoE layer,
    where the policy keeps every matmul output but those of width h, the float32 router logits 4E
    and per routed copy (and shared expert) the gate and up projections' outputs 4*hm. This is
    kiln.model.activations.layer_activation_bytes_per_token's count, measured on one process; the
    tensor-parallel division and the reduce-scatter outputs are read off the policy, not measured.
    """
    h, a = cfg.dim, cfg.n_heads
    residual = (act.residual_bytes if residual_bytes is None else residual_bytes) * h
    if ac == "full":  # only the block input (sequence-sharded under SP) is kept
        return tokens * residual / tp
    if ac == "selective" and act.op_selective:
        kept = residual + 2 * h + 4 * h * cfg.kv_heads / a + 2 * h + 4 * a + (4 * h if tp > 1 else 0)
        if moe:
            kept += 4 * cfg.n_experts + (cfg.moe_top_k + cfg.moe_shared_expert) * 4 * cfg.moe_hidden_size
        else:
            kept += (4 if cfg.ffn == "swiglu" else 2) * cfg.ffn_hidden_size
        return tokens * kept / tp
    mask = h if act.dropout else 0
    sharded = 2 * h + 2 * h + 4 * h * cfg.kv_heads / a + 2 * h + mask + 2 * h  # attention side, ffn norm
    if cfg.qk_norm:  # the q and k norms' inputs, and their per-head statistics
        sharded += 2 * h + 2 * h * cfg.kv_heads / a + (4 * (a + cfg.kv_heads) if act.statistics else 0)
    sharded += 4 * a + 2 * 4 if act.statistics else 0
    gathered = 2 * h
    if moe:
        hm = cfg.moe_hidden_size
        sharded += 6 * h + 8 * cfg.n_experts + cfg.moe_top_k * (4 * h + 8 * hm) + cfg.moe_shared_expert * 8 * hm
    else:
        sharded += (8 if cfg.ffn == "swiglu" else 4) * cfg.ffn_hidden_size + mask
        gathered += 2 * h
    scores = 0.0 if act.flash or ac == "selective" else a * seq_len * (5 if act.dropout else 2)
    return tokens * ((sharded + scores) / tp + (gathered if act.sp_gathered_inputs else gathered / tp))


def in_flight(lay: Layout, rank: int, microbatches: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of its layers."""
    p, m, v = lay.pp, microbatches, lay.pp_stages_per_rank
    if p == 1:
        return 1.0  # gradient accumulation runs micro-batches one after another
    if lay.pp_schedule == "gpipe":
        return float(m)
    if lay.pp_schedule == "interleaved_1f1b":
        # Megatron's warm-up count for rank r in chunks of layers/v; on rank 0, p*(v+1)-1 chunks:
        # the (1 + (p-1)/(p*v)) factor of Korthikanti et al. sec. 4.2.3.
        return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v) / v
    return float(min(p - rank, m))


def model_state_bytes(
    psi: float, zero: int, shards: int, full_grads: bool = False, state_per_param: float = 8.0
) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) in bytes for psi parameters (ZeRO paper sec. 5):
    fp16 weights 2, fp16 gradients 2, fp32 master weights 4 + the optimizer's state (Adam's m and v:
    8, kiln.parallel.optimizer_state for the others), partitioned by stage. `full_grads`: the
    gradients accumulate unsharded over the step (deferred_grad_sync) whatever the stage."""
    d = max(shards, 1)
    grads = 2 * psi / (d if zero >= 2 and not full_grads else 1)
    return 2 * psi / (d if zero >= 3 else 1), grads, (4 + state_per_param) * psi / (d if zero >= 1 else 1)


def deferred_grad_sync(lay: Layout) -> bool:
    """FSDP gradients accumulate unsharded over the step's micro-batches and are reduce-scattered
    once: ZeRO-1 (grad_sync = "deferred"), and every FSDP layout under pipelining, whose torch
    schedule turns gradient sync off until its last micro-batch's backward."""
    return lay.zero == 1 or (lay.zero > 0 and lay.pp > 1)


@dataclass
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float
    rank: int

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.logits + self.buffers

    def as_gb(self) -> dict:
        out = {k: round(v / GB, 2) for k, v in dataclasses.asdict(self).items() if k != "rank"}
        return out | {"total": round(self.total / GB, 2), "pipeline_rank": self.rank}


# layer_activation_bytes and the logits term count 16-bit values.
PLANNER_VALUE_BYTES = 2
# Per logit: the 16-bit logits, the fp32 copy the loss takes its log-softmax of, and that copy's fp32
# gradient. Only the log-softmax output (fp32, 4) is kept through the forward; the other two exist
# while the loss backpropagates.
LOGIT_BYTES = {"logits": 2, "fp32_copy": 4, "fp32_grad": 4}


def logits_bytes(
    cfg: ModelConfig, tokens: float, tp: int = 1, forward_only: bool = False, value_bytes: int = PLANNER_VALUE_BYTES
) -> float:
    """Bytes of the last rank's loss-side tensors: the logits per LOGIT_BYTES (vocabulary-parallel
    under TP), plus the final norm's input and the head's (gathered) input at `value_bytes` each.
    `forward_only`: what is held at the end of the forward (of the logits, the fp32 log-softmax)."""
    per_logit = LOGIT_BYTES["fp32_copy"] if forward_only else sum(LOGIT_BYTES.values())
    return tokens * (cfg.vocab_size * per_logit / tp + value_bytes * cfg.dim / tp + value_bytes * cfg.dim)


def layer_autocast_params(cfg: ModelConfig, moe: bool = False) -> int:
    """Parameters of one block that autocast copies to 16 bit: the weights of its matmuls. Norm gains
    (Kiln's RMSNorm computes in float32) and MoE routers (run with autocast off) are used in fp32."""
    norms = 2 * (cfg.dim if cfg.norm == "rmsnorm" else 2 * cfg.dim)
    return layer_params(cfg, moe) - norms - (cfg.dim * cfg.n_experts if moe else 0)


def stage_counts(cfg: ModelConfig, lay: Layout) -> list[tuple[int, int]]:
    """(layers, of which MoE layers) on each pipeline rank."""
    moe = [is_moe(cfg, i) for i in range(cfg.n_layers)]
    stages = stage_layer_ids(cfg, lay.pp, lay.pp_stages_per_rank)
    return [(len(ids), sum(moe[i] for i in ids)) for ids in stages]


def representative_ranks(counts: list[tuple[int, int]]) -> list[int]:
    """The pipeline ranks that can hold a peak: the first, the last, and the first of each distinct
    (layers, MoE layers) in between (later ranks with the same layers hold fewer micro-batches)."""
    ranks, seen = {0, len(counts) - 1}, set()
    for r in range(1, len(counts) - 1):
        if counts[r] not in seen:
            seen.add(counts[r])
            ranks.add(r)
    return sorted(ranks)


def rank_params(cfg: ModelConfig, lay: Layout, layers: int, n_moe: int, rank: int) -> tuple[float, float]:
    """(parameters split by TP, routed-expert parameters split by EP) on a pipeline rank."""
    experts = n_moe * routed_expert_params(cfg) if n_moe else 0
    dense = (layers - n_moe) * layer_params(cfg) + (n_moe * layer_params(cfg, True) - experts if n_moe else 0)
    if rank == 0:
        dense += embedding_params(cfg)
    if rank == lay.pp - 1:
        dense += cfg.dim if cfg.norm == "rmsnorm" else 2 * cfg.dim  # the final norm
        if not cfg.tie_embeddings or lay.pp > 1:
            dense += cfg.vocab_size * cfg.dim  # with pipelining a tied head still needs its own copy
    return dense / lay.tp, experts / lay.ep


def rank_autocast_params(cfg: ModelConfig, lay: Layout, layers: int, n_moe: int, rank: int) -> float:
    """Matmul weights autocast copies on a pipeline rank: its blocks' (routed experts split by EP,
    the rest by TP) and, on the last rank, the output head's."""
    experts = n_moe * routed_expert_params(cfg)
    dense = (layers - n_moe) * layer_autocast_params(cfg) + n_moe * layer_autocast_params(cfg, True) - experts
    if rank == lay.pp - 1:
        dense += cfg.vocab_size * cfg.dim
    return dense / lay.tp + experts / lay.ep


def block_params(cfg: ModelConfig, lay: Layout, moe: bool) -> float:
    """Parameters of one block on one rank: what FSDP gathers at a time."""
    experts = routed_expert_params(cfg) if moe else 0
    return (layer_params(cfg, moe) - experts) / lay.tp + experts / lay.ep


def memory(
    cfg: ModelConfig,
    lay: Layout,
    work: Workload,
    act: ActivationModel = KILN,
    counts: list[tuple[int, int]] | None = None,
    state: OptimizerState | None = None,
) -> Memory:
    """Peak bytes per GPU: the largest over the pipeline ranks. `counts` and `state` (the layout's
    stage_counts, the workload's optimizer_state) are passed by a search that has them already."""
    counts = counts or stage_counts(cfg, lay)
    state = state or optimizer_state(cfg, work.optimizer)
    m = work.global_seqs // lay.dp // lay.micro_batch
    tokens = lay.micro_batch * work.seq_len // lay.cp
    kinds = (False, True) if any(n_moe for _, n_moe in counts) else (False,)
    # FSDP's bf16 parameters (param_dtype) make the residual stream, which checkpointing keeps, bf16.
    residual = 2 if lay.zero else None
    per_layer = {
        moe: layer_activation_bytes(cfg, work.seq_len, tokens, lay.tp, lay.ac, act, moe, residual) for moe in kinds
    }
    per_layer.setdefault(True, 0.0)
    deferred = deferred_grad_sync(lay) and m > 1
    worst = None
    for r in representative_ranks(counts):
        layers, n_moe = counts[r]
        dense, experts = rank_params(cfg, lay, layers, n_moe, r)
        states = [
            a + b
            for a, b in zip(
                model_state_bytes(dense, lay.zero, lay.shard_degree, deferred, state.dense_bytes_per_param),
                model_state_bytes(
                    experts, lay.zero, lay.shard_degree // lay.ep, deferred, state.expert_bytes_per_param
                ),
            )
        ]
        acts = in_flight(lay, r, m) * ((layers - n_moe) * per_layer[False] + n_moe * per_layer[True])
        # Backward rematerialises one checkpointed block at a time (under selective, all but what the
        # policy kept; counted whole, at most one layer's kept bytes too many).
        if lay.ac != "none":
            acts += layer_activation_bytes(cfg, work.seq_len, tokens, lay.tp, "none", act, n_moe > 0)
        block = max(
            block_params(cfg, lay, False) if layers > n_moe else 0.0, block_params(cfg, lay, True) if n_moe else 0.0
        )
        # FSDP's unsharded working set: bf16 weights of the current and the prefetched block, and the
        # current block's fp32 gradients before their reduce-scatter (counted in grads when deferred).
        unsharded_fp32 = lay.zero == 0 and act.fp32_weights_unsharded
        buffers = {3: block * 2 * 2, 2: 0.0}.get(lay.zero, 0.0) + (block * 4 if lay.zero >= 2 and not deferred else 0.0)
        if unsharded_fp32:  # autocast's 16-bit copies of the rank's matmul weights (kiln.parallel.plan_check)
            buffers += 2 * rank_autocast_params(cfg, lay, layers, n_moe, r)
        logits = 0.0
        if r == lay.pp - 1:
            # bf16 logits, their fp32 copy for the loss and its fp32 gradient (vocabulary-parallel
            # under TP), plus the final norm's input and the head's gathered input.
            logits = logits_bytes(cfg, tokens, lay.tp)
        if state.muon_shapes and (lay.zero or lay.tp > 1):
            # Muon gathers one sharded matrix whole at a time, with its orthogonalised copy (fp32).
            buffers += 2 * 4 * max(math.prod(shape) for shape, _ in state.muon_shapes)
        mem = Memory(*states, acts, logits, buffers, r)
        if worst is None or mem.total > worst.total:
            worst = mem
    return worst


# ----------------------------------------------------------------------------- search
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: ModelConfig, cluster: ClusterConfig, work: Workload, act: ActivationModel = KILN):
    """The layouts the search considers: tp over the divisors of a node, pp over the divisors of
    what is left (up to n_layers), cp where each rank keeps >= 2048 tokens, then DDP, FSDP (ZeRO 1, 2,
    3) or HSDP (a node-sized shard group) for the data-parallel rest, ep over the divisors of
    n_experts that fit in dp_shard*cp, activation checkpointing off, selective (Kiln's op-level policy, or
    Megatron's where attention is not flash) or full, micro-batches dividing each replica's batch, and 1F1B or interleaved
    1F1B with 2, 4 or 8 stages per rank."""
    world, moe = cluster.world, moe_layer_count(cfg) > 0
    for tp in [t for t in _divisors(cluster.gpus_per_node) if world % t == 0]:
        for pp in [d for d in _divisors(world // tp) if d <= cfg.n_layers]:
            for cp in [
                c for c in _divisors(world // tp // pp) if c == 1 or (c & (c - 1) == 0 and work.seq_len // c >= 2048)
            ]:
                dp = world // (tp * pp * cp)
                per_replica = work.global_seqs // dp if work.global_seqs % dp == 0 else 0
                splits = {(dp, 1, 0)} | ({(1, dp, z) for z in (1, 2, 3)} if dp * cp > 1 else set())
                node_shard = cluster.gpus_per_node // (tp * cp) if cluster.gpus_per_node % (tp * cp) == 0 else 0
                if 1 < node_shard < dp and dp % node_shard == 0:
                    splits |= {(dp // node_shard, node_shard, z) for z in (1, 2, 3)}
                stages = [1] + [v for v in (2, 4, 8) if pp > 1 and pp * v <= cfg.n_layers]
                for rep, shard, zero in sorted(splits):
                    eps = [e for e in _divisors(cfg.n_experts) if (shard * cp) % e == 0] if moe else [1]
                    for ep in eps:
                        for ac in AC_MODES if act.op_selective or not act.flash else ("none", "full"):
                            for mb in [b for b in (1, 2, 4, 8, 16, 32, 64) if per_replica % b == 0]:
                                for v in stages:
                                    yield Layout(
                                        rep,
                                        shard,
                                        tp,
                                        pp,
                                        cp,
                                        ep,
                                        zero,
                                        ac,
                                        mb,
                                        "1f1b" if v == 1 else "interleaved_1f1b",
                                        v,
                                    )
