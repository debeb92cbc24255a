"""The planner's memory model for one device running Kiln's trainer as it is, term by term, from
the planner's own formulas (kiln.parallel.plan): what kiln.train.memcheck measures on a real step.
Torch-free, like the planner; docs/plan.md, "Checked against the trainer".
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, replace

from kiln.errors import ConfigError
from kiln.model.config import ModelConfig
from kiln.parallel.optimizer_state import optimizer_state
from kiln.parallel.plan import (
    KILN,
    PLANNER_VALUE_BYTES,
    is_moe,
    layer_activation_bytes,
    layer_autocast_params,
    logits_bytes,
    moe_layer_count,
    routed_expert_params,
    total_params,
)

# Bytes per parameter of the model states, as Kiln's trainer holds them on one device (and per shard
# under FSDP): fp32 weights and fp32 gradients (the optimizer steps the weights themselves, so they are
# the ZeRO paper's fp32 master copy), then the optimizer's own state (kiln.parallel.optimizer_state:
# 8 for AdamW). The ZeRO split of model_state_bytes (2 + 2 + 12) totals the same 16 for AdamW.
TRAINER_PARAM_BYTES, TRAINER_GRAD_BYTES = 4, 4
# Bytes per value of each train.precision (kiln.train.precision.PRECISION_DTYPES): what autocast
# computes, casts weights to and saves activations in. The residual stream stays float32 (the fp32
# weights' dtype, KILN.residual_bytes), so it is what a checkpointed block keeps.
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Float32 statistics a stored block also keeps per token, counted here rather than by layer_activation_bytes
# (under 1% of a block's bytes at h >= 1024): SDPA's logsumexp per head and each RMSNorm's
# reciprocal RMS (kiln.model.activations counts both).
STAT_BYTES = 4


def autocast_params(cfg: ModelConfig) -> int:
    """Parameters autocast copies to 16 bit in each forward: every block's matmul weights and the
    output head's (a tied head's is the embedding table; the embedding lookup itself uses fp32)."""
    blocks = sum(layer_autocast_params(cfg, is_moe(cfg, layer)) for layer in range(cfg.n_layers))
    return blocks + cfg.vocab_size * cfg.dim


@dataclass
class TrainerMemory:
    """Bytes a Kiln trainer step holds on one device without parallelism, term by term: fp32 weights,
    their gradients at the peak of accumulation, optimizer state, autocast's 16-bit weight copies, the
    activations the blocks keep through one micro-batch's forward, and what the embedding, final norm
    and loss keep ("logits"). kiln.train.memcheck measures the same terms on a real step."""

    params: float
    grads: float
    optimizer: float
    autocast: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return sum(astuple(self))


def trainer_memory(
    cfg: ModelConfig,
    precision: str,
    micro_batch: int,
    seq_len: int,
    ac: str = "none",
    optimizer: str = "adamw",
) -> TrainerMemory:
    """The planner's memory model for one device running Kiln's trainer as it is (fp32 weights under
    autocast, micro-batches one after another): model_state_bytes' 16 bytes per parameter split as
    the trainer holds them, layer_activation_bytes and logits_bytes at the trainer's value width.
    No term depends on gradient accumulation: micro-batches run one after another and add their
    gradients into the same fp32 tensors."""
    if precision not in PRECISION_BYTES:
        raise ConfigError("precision", f"must be one of {', '.join(PRECISION_BYTES)}, got {precision!r}")
    if ac not in ("none", "full"):
        raise ConfigError("activation_checkpointing", f"the trainer runs ac none or full, not {ac!r}")
    state = optimizer_state(cfg, optimizer)  # refuses an optimizer it does not know, by key
    psi = total_params(cfg)
    value = PRECISION_BYTES[precision]
    cast = autocast_params(cfg)
    if ac == "full":
        # Autocast caches the copy of a whole parameter for its context; the routed experts are cast
        # slice by slice (one expert's weights), uncached, so they live only as long as autograd saves
        # them: inside a checkpointed block, during its forward or its recomputation alone.
        cast -= moe_layer_count(cfg) * routed_expert_params(cfg)
    tokens = micro_batch * seq_len
    # A checkpointed block keeps the fp32 residual stream (KILN.residual_bytes, already in bytes);
    # stored blocks keep compute-dtype values. The float32 statistics are counted below, unscaled.
    scale = 1 if ac == "full" else value / PLANNER_VALUE_BYTES
    values_only = replace(KILN, statistics=False)
    acts = sum(
        layer_activation_bytes(cfg, seq_len, tokens, 1, ac, values_only, is_moe(cfg, i)) for i in range(cfg.n_layers)
    )
    stats = 0 if ac == "full" else tokens * cfg.n_layers * STAT_BYTES * (cfg.n_heads + 2)
    # Under autocast the model casts its RoPE cos and sin tables to the compute dtype once per
    # forward and every block keeps them (in fp32 they are views of the model's buffers).
    if cfg.pos == "rope" and precision != "fp32":
        stats += 2 * seq_len * cfg.head_dim * value
    # Besides the logits: the final norm's reciprocal RMS, and the int64 token ids and targets that
    # the embedding and the loss keep.
    loss_side = logits_bytes(cfg, tokens, forward_only=True, value_bytes=value) + tokens * (STAT_BYTES + 2 * 8)
    return TrainerMemory(
        params=TRAINER_PARAM_BYTES * psi,
        grads=TRAINER_GRAD_BYTES * psi,
        optimizer=float(state.state_bytes),
        autocast=value * cast if precision != "fp32" else 0.0,
        activations=acts * scale + stats,
        logits=loss_side,
    )
