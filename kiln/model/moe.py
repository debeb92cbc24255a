"""Mixture-of-Experts feed-forward: a top-k token-choice router over SwiGLU experts.

Each token's router logits pick its `moe_top_k` experts; the token is sent to each of them and their
outputs are summed, weighted by the router probabilities. Formulas (docs/moe.md):
- routing: p = softmax(router(x)) in float32; the top-k of p are the gates. With `moe_norm_topk` the k
  gates are divided by their sum (Mixtral, Qwen-MoE's norm_topk_prob); without it they stay the raw
  probabilities (Switch Transformer, DeepSeek-V2).
- load balance (Switch Transformer, eq. 4): aux = E * sum_i f_i * P_i, with f_i the fraction of the
  N*k token-to-expert assignments that chose expert i (before any capacity drop) and P_i the mean
  router probability of expert i. Its minimum, 1, is reached by a uniform router.
- router z-loss (ST-MoE, eq. 5): mean over tokens of logsumexp(logits)^2; keeps logits small so the
  float32 softmax stays well conditioned.
- capacity: with `moe_capacity_factor` cf > 0, each expert takes at most ceil(cf * N * k / E)
  assignments; first choices are served before second choices (GShard), and within one choice
  earlier tokens first. A dropped assignment adds nothing (the block's residual carries the token).

Tokens are dispatched by sorting the assignments by expert and running each expert on its
contiguous slice, so compute grows with k, not with E. No parallelism lives here: expert
parallelism (kiln/parallel/expert.py) wraps `GroupedExperts` from outside with hooks that move the
sorted tokens to the ranks owning their experts, and installs `gather_counts` so that capacity and
the load-balance statistics are computed over every rank's tokens.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.model.config import ModelConfig


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU with the dense FeedForward's matrices: w1 the gate, w3 the up, w2 the down projection."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _local(param: torch.Tensor) -> torch.Tensor:
    # Under expert parallelism the weights are DTensors sharded on the expert dimension; the
    # experts module computes on this rank's shard only.
    return param.to_local() if hasattr(param, "to_local") else param


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as 3-D weights: w1 and w3 [E, hidden, dim], w2 [E, dim, hidden].

    forward(x, counts): x holds tokens grouped by expert (counts[e] rows for expert e, in order).
    Batched 3-D parameters (rather than E modules) let expert parallelism shard experts as one
    tensor dimension and keep checkpoint names independent of the parallel layout.
    """

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = _local(self.w1), _local(self.w3), _local(self.w2)
        # A loop over slices: torch._grouped_mm exists on CPU in torch 2.13 but its backward fails
        # there ("Invalid strides/sizes"). Empty slices still run, so every expert weight is part of
        # the graph and gets a (zero) gradient even when no token chose it.
        slices = torch.split(x, counts.tolist())
        # unbind, not w1[e]: the backward of E separate indexings would build E zero-filled
        # full-size gradients and add them up; unbind's backward stacks the E pieces once.
        experts = zip(slices, w1.unbind(0), w3.unbind(0), w2.unbind(0))
        return torch.cat([swiglu(chunk, gate, up, down) for chunk, gate, up, down in experts])


class SharedExpert(nn.Module):
    """A dense SwiGLU applied to every token next to the routed experts (DeepSeekMoE)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.moe_top_k
        self.norm_topk = cfg.moe_norm_topk
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_loss_weight, self.z_loss_weight = cfg.moe_aux_loss_weight, cfg.moe_z_loss_weight
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.moe_hidden_size)
        self.shared_expert = SharedExpert(cfg.dim, cfg.moe_hidden_size) if cfg.moe_shared_expert else None
        # Set by expert parallelism: counts [k, E] of this rank -> ([ranks, k, E] of every rank of the
        # group, this rank's index). None: the tokens of this forward are all there is.
        self.gather_counts: Callable[[torch.Tensor], tuple[torch.Tensor, int]] | None = None
        # Results of the last forward, read by moe_aux_loss and moe_stats.
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None
        self.routed: torch.Tensor | None = None

    @torch.no_grad()
    def init_weights(self, init_std: float, residual_std: float) -> None:
        nn.init.normal_(self.router.weight, std=init_std)
        experts = self.experts
        for param, std in ((experts.w1, init_std), (experts.w3, init_std), (experts.w2, residual_std)):
            _init_per_expert(param, std)
        if self.shared_expert is not None:
            for up in (self.shared_expert.w1, self.shared_expert.w3):
                nn.init.normal_(up.weight, std=init_std)
            nn.init.normal_(self.shared_expert.w2.weight, std=residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n_tokens, k, n_experts = x.shape[0], self.top_k, self.n_experts
        # The router runs in float32 even under autocast: bf16 logits round differences between
        # experts away and make the top-k choice noisy (Switch Transformer's "selective precision").
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
        probs = logits.softmax(dim=-1)
        gates, chosen = probs.topk(k, dim=-1)  # [N, k]
        if self.norm_topk:
            gates = gates / gates.sum(dim=-1, keepdim=True)

        # Assignments in choice-major order (all first choices, then all second choices...): the
        # order in which capacity is handed out.
        expert_of = chosen.t().reshape(-1)  # [k*N]
        slot_expert = torch.arange(k, device=x.device).repeat_interleave(n_tokens) * n_experts + expert_of
        counts = torch.zeros(k * n_experts, dtype=torch.long, device=x.device)
        counts = counts.scatter_add_(0, slot_expert, torch.ones_like(slot_expert)).view(k, n_experts)
        table, rank = self.gather_counts(counts) if self.gather_counts is not None else (counts[None], 0)
        n_ranks = table.shape[0]
        totals = table.sum(0)  # [k, E] over every rank's tokens
        tokens_all = totals[0].sum()  # each token has one first choice

        # Each rank's loss is scaled by n_ranks * N_rank / N_all, so that the average over ranks (what
        # data parallelism applies to gradients) is the loss over the union of their tokens.
        share = n_ranks / tokens_all
        load = totals.sum(0).float() / (k * tokens_all)  # f_i
        self.aux_loss = n_experts * (load * probs.sum(0)).sum() * share
        self.z_loss = torch.logsumexp(logits, dim=-1).square().sum() * share

        order = torch.argsort(expert_of, stable=True)  # grouped by expert, choice-major inside
        token_of, slot_of = order % n_tokens, order // n_tokens
        sorted_expert = expert_of[order]
        kept_counts = counts.sum(0)
        self.tokens_per_expert = totals.sum(0)
        self.routed = tokens_all * k
        if self.capacity_factor > 0:
            # Without expert parallelism the token count is static: no device sync, no graph break.
            tokens = n_tokens if self.gather_counts is None else int(tokens_all)
            capacity = math.ceil(self.capacity_factor * tokens * k / n_experts)
            # Position of each assignment in its expert's queue over all ranks, in the order the
            # union of the ranks' batches (rank 0's tokens first) would have on one process.
            local_start = kept_counts.cumsum(0) - kept_counts
            position = torch.arange(order.numel(), device=x.device) - local_start[sorted_expert]
            earlier = (totals.cumsum(0) - totals) + table[:rank].sum(0) - (counts.cumsum(0) - counts)
            position = position + earlier[slot_of, sorted_expert]
            keep = position < capacity
            order, token_of, sorted_expert = order[keep], token_of[keep], sorted_expert[keep]
            kept_counts = torch.zeros_like(kept_counts).scatter_add_(0, sorted_expert, torch.ones_like(sorted_expert))
            self.dropped = (totals.sum(0) - capacity).clamp(min=0).sum()
        else:
            self.dropped = torch.zeros((), dtype=torch.long, device=x.device)

        out = self.experts(x[token_of], kept_counts)
        # Gates are float32, so the weighted sum of the k outputs is accumulated in float32.
        out = out * gates.t().reshape(-1)[order].unsqueeze(-1)
        combined = torch.zeros(n_tokens, shape[-1], dtype=out.dtype, device=x.device).index_add_(0, token_of, out)
        if self.shared_expert is not None:
            combined = combined + self.shared_expert(x)
        return combined.to(x.dtype).view(shape)


def _init_per_expert(param: torch.Tensor, std: float) -> None:
    """Normal init drawn one expert at a time in expert order, keeping only this rank's experts.

    Every rank draws the same sequence, so a model sharded over any number of expert-parallel ranks
    gets the weights the single-process model gets from the same seed (DTensor's own random init
    on a CPU mesh gives every rank the same values for its shard instead).
    """
    local = _local(param)
    if local is param:
        first = 0
    else:
        first = param.device_mesh.get_local_rank() * local.shape[0]
    for expert in range(param.shape[0]):
        weights = torch.empty(param.shape[1:], device=local.device, dtype=local.dtype).normal_(std=std)
        if first <= expert < first + local.shape[0]:
            local[expert - first].copy_(weights)


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Weighted load-balance plus z-loss of the last forward, summed over MoE layers; add it to the
    LM loss. None when the model has no MoE layer (or has not run forward yet)."""
    total = None
    for layer in moe_layers(model):
        if layer.aux_loss is None:
            continue
        term = layer.aux_loss_weight * layer.aux_loss + layer.z_loss_weight * layer.z_loss
        total = term if total is None else total + term
    return total


@torch.no_grad()
def moe_stats(model: nn.Module) -> dict[str, float]:
    """Routing health of the last forward, averaged over MoE layers (empty for a dense model).

    dropped_frac: assignments dropped by capacity / all assignments. load_max: the busiest expert's
    assignments over the mean (1.0 is perfect balance, E means one expert took everything).
    load_cv: coefficient of variation of assignments per expert. aux_loss, z_loss: unweighted.
    """
    layers = [m for m in moe_layers(model) if m.aux_loss is not None]
    if not layers:
        return {}
    dropped = routed = 0
    load_max = load_cv = aux = z = 0.0
    for layer in layers:
        dropped += int(layer.dropped)
        routed += int(layer.routed)
        load = layer.tokens_per_expert.float()
        load_max += float(load.max() / load.mean().clamp(min=1e-9))
        load_cv += float(load.std(correction=0) / load.mean().clamp(min=1e-9))
        aux += float(layer.aux_loss)
        z += float(layer.z_loss)
    n = len(layers)
    return {
        "dropped_frac": dropped / max(routed, 1),
        "load_max": load_max / n,
        "load_cv": load_cv / n,
        "aux_loss": aux / n,
        "z_loss": z / n,
    }
