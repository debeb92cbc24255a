"""What each of Kiln's optimizers (train.optimizer, kiln.train.optim) keeps and computes per step,
for the planners: the trainer's memory model (kiln.parallel.plan_check) and the cluster planner
(kiln.parallel.plan, plan_time). Arithmetic on the config, like the rest of the planner.

State is float32, one value per element of what it shadows: AdamW's m and v; Lion's m; Adafactor's
factored second moment (torch.optim.Adafactor: a row and a column vector per trailing matrix, a full
vector per 1-D tensor); Muon's momentum for the blocks' 2-D weights (kiln.train.muon.muon_split) and
AdamW's m and v for the rest (embeddings, head, norms, biases, MoE expert banks). The per-tensor
float32 step counters of AdamW and Adafactor (4 bytes a tensor) are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.errors import ConfigError
from kiln.model.config import ModelConfig

OPTIMIZERS = ("adamw", "lion", "adafactor", "muon")
STATE_BYTES = 4  # float32


@dataclass(frozen=True)
class ParamShape:
    shape: tuple[int, ...]
    block_matrix: bool  # a 2-D weight inside a block: what Muon orthogonalises
    expert: bool = False  # a routed-expert bank (what expert parallelism splits)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_shapes(cfg: ModelConfig) -> list[tuple[ParamShape, int]]:
    """Every parameter tensor of the decoder kiln.model.transformer builds for `cfg`, as (shape, how
    many tensors have it), in no particular order (tests/parallel/test_optimizer_state.py checks it
    against the module). One entry per kind of block, not per layer: the planner asks for it for
    every layout it searches."""
    h, hd = cfg.dim, cfg.head_dim
    qkv = (cfg.n_heads + 2 * cfg.kv_heads) * hd
    norms = 1 if cfg.norm == "rmsnorm" else 2  # gain, and LayerNorm's bias
    n_moe = sum(cfg.is_moe_layer(layer) for layer in range(cfg.n_layers))
    block = [  # what every block has: its two norms and attention
        (ParamShape((h,), False), 2 * norms),
        (ParamShape((qkv, h), True), 1),
        (ParamShape((h, cfg.n_heads * hd), True), 1),
        (ParamShape((qkv,), False), 1 if cfg.qkv_bias else 0),
        (ParamShape((hd,), False), 2 if cfg.qk_norm else 0),
    ]
    f = cfg.ffn_hidden_size
    dense = [(ParamShape((f, h), True), 2 if cfg.ffn == "swiglu" else 1), (ParamShape((h, f), True), 1)]
    e, g = cfg.n_experts, cfg.moe_hidden_size
    moe = [
        (ParamShape((e, h), True), 1),  # the router
        (ParamShape((e, g, h), False, True), 2),  # 3-D expert banks: w1, w3
        (ParamShape((e, h, g), False, True), 1),  # w2
        (ParamShape((g, h), True), 2 if cfg.moe_shared_expert else 0),
        (ParamShape((h, g), True), 1 if cfg.moe_shared_expert else 0),
    ]
    out = [(ParamShape((cfg.vocab_size, h), False), 2 if not cfg.tie_embeddings else 1)]  # embedding, head
    out.append((ParamShape((cfg.max_seq_len, h), False), 1 if cfg.pos == "learned" else 0))
    out.append((ParamShape((h,), False), norms))  # the final norm
    out += [(p, n * cfg.n_layers) for p, n in block]
    out += [(p, n * (cfg.n_layers - n_moe)) for p, n in dense] + [(p, n * n_moe) for p, n in moe]
    return [(p, n) for p, n in out if n]


@dataclass(frozen=True)
class OptimizerState:
    """One optimizer over one model: its state in bytes and the parameters it shadows, each also for
    the routed-expert banks alone, and the shapes of the matrices Muon orthogonalises every step
    (empty for the other optimizers)."""

    state_bytes: int
    params: int
    expert_state_bytes: int = 0
    expert_params: int = 0
    muon_shapes: tuple[tuple[tuple[int, ...], int], ...] = ()  # (matrix shape, how many)

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / self.params

    @property
    def dense_bytes_per_param(self) -> float:
        """State bytes per parameter outside the expert banks (the planner's `dense` parameters)."""
        return (self.state_bytes - self.expert_state_bytes) / (self.params - self.expert_params)

    @property
    def expert_bytes_per_param(self) -> float:
        return self.expert_state_bytes / self.expert_params if self.expert_params else 0.0

    def newton_schulz_flops(self, steps: int) -> float:
        """FLOPs of Muon's orthogonalisation (kiln.train.muon.newton_schulz) of every matrix once: per
        iteration on an m x n matrix (m the short side) the Gram matrix X X^T (2 m^2 n), the product
        of that with itself (2 m^3) and with X (2 m^2 n)."""
        total = 0.0
        for (rows, cols), count in self.muon_shapes:
            m, n = min(rows, cols), max(rows, cols)
            total += count * steps * (4.0 * m * m * n + 2.0 * m**3)
        return total

    @property
    def muon_params(self) -> int:
        """Elements of the matrices Muon orthogonalises."""
        return sum(count * math.prod(shape) for shape, count in self.muon_shapes)


def state_values(p: ParamShape, optimizer: str) -> int:
    """float32 values of `optimizer`'s state for one parameter tensor."""
    if optimizer == "adamw" or (optimizer == "muon" and not p.block_matrix):
        return 2 * p.numel
    if optimizer in ("lion", "muon"):
        return p.numel
    if len(p.shape) >= 2:  # adafactor
        *lead, rows, cols = p.shape
        return math.prod(lead) * (rows + cols)
    return p.numel


def optimizer_state(cfg: ModelConfig, optimizer: str) -> OptimizerState:
    """The state `optimizer` keeps for every parameter of `cfg`'s decoder."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError("optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    shapes = param_shapes(cfg)
    experts = [(p, n) for p, n in shapes if p.expert]
    return OptimizerState(
        state_bytes=STATE_BYTES * sum(n * state_values(p, optimizer) for p, n in shapes),
        params=sum(n * p.numel for p, n in shapes),
        expert_state_bytes=STATE_BYTES * sum(n * state_values(p, optimizer) for p, n in experts),
        expert_params=sum(n * p.numel for p, n in experts),
        muon_shapes=tuple((p.shape, n) for p, n in shapes if p.block_matrix) if optimizer == "muon" else (),
    )
