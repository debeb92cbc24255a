"""Expert parallelism: each rank of an EP group holds n_experts / ep of every MoE layer's experts.

Applied from outside to the plain model (kiln/model/moe.py), in three pieces per MoE layer:
- the 3-D expert weights become DTensors sharded on the expert dimension (Shard(0)) over the EP mesh,
  so checkpoints (torch.distributed.checkpoint) and FSDP2 see one logical tensor;
- `MoEFeedForward.gather_counts` all-gathers every rank's [k, E] routing counts, so the capacity
  limit and the load-balance loss are those of the union of the ranks' batches, and the per-rank
  routing losses are scaled so that their average over ranks is the union's loss;
- hooks around `GroupedExperts` (torch.distributed.tensor.distribute_module): before it, the tokens,
  already sorted by expert, go to the ranks that own their experts with one all-to-all (split sizes
  exchanged first); after it, a second all-to-all brings the results back in the original order.

Gradient convention: every rank's tokens reach the owner of their experts, so an expert weight's
gradient sums the contributions of every rank's loss. It is divided by the EP size inside the
all-to-all's backward, making it the average over ranks of their local-loss gradients: the same
convention as DDP and FSDP for the replicated weights (router, attention, shared expert), which
still need the usual data-parallel average over the same ranks. Composed with FSDP2 on a mesh of
the remaining data-parallel ranks, its default averaging then gives the full-batch gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module

from kiln.errors import ConfigError
from kiln.model.moe import GroupedExperts, moe_layers


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: the backward sends gradients back along the reverse splits.

    Written here rather than using torch.distributed.nn.functional: those collectives return wrong
    gradients on gloo when the incoming gradient is not contiguous (measured for all_gather, see
    the project's feasibility notes), and the backward also applies `grad_scale`.
    """

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group, grad_scale: float):
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.grad_scale = out_splits, in_splits, group, grad_scale
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.grad_scale != 1.0:
            grad = grad * ctx.grad_scale
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad, ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None, None


class _TokenDispatcher:
    """The pre- and post-forward hooks of one GroupedExperts: tokens out to owners, results back."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        # Set by the pre-hook, read by the post-hook of the same forward; the backward keeps its own
        # copies in the autograd graph, so overlapping microbatches do not need this state.
        self._perm = self._send_splits = self._recv_splits = None

    def dispatch(self, module, inputs, mesh):
        x, counts = inputs  # rows grouped by global expert; counts [E]
        per_rank = counts.view(self.size, -1)  # [destination rank, its local experts]
        received = torch.empty_like(per_rank)  # [source rank, my local experts]
        dist.all_to_all_single(received, per_rank.contiguous(), group=self.group)
        self._send_splits = per_rank.sum(1).tolist()
        self._recv_splits = received.sum(1).tolist()
        # Grads coming back through here are scaled by 1 / size in `combine`; undo it for the tokens.
        x = _AllToAll.apply(x, self._recv_splits, self._send_splits, self.group, float(self.size))
        # Received rows are ordered (source rank, local expert); the experts need them by expert.
        n_local = received.shape[1]
        chunk = torch.repeat_interleave(torch.arange(received.numel(), device=x.device), received.flatten())
        source, expert = chunk // n_local, chunk % n_local
        self._perm = torch.argsort(expert * self.size + source, stable=True)
        return x[self._perm], received.sum(0)

    def combine(self, module, out, mesh):
        out = out[torch.argsort(self._perm)]
        # Expert weight gradients add up every rank's loss; 1 / size makes them the data-parallel mean.
        return _AllToAll.apply(out, self._send_splits, self._recv_splits, self.group, 1.0 / self.size)


def _gather_counts(counts: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    size = dist.get_world_size(group)
    table = counts.new_empty((size * counts.shape[0], *counts.shape[1:]))
    dist.all_gather_into_tensor(table, counts.contiguous(), group=group)  # gloo wants dim 0 concatenated
    return table.view(size, *counts.shape), dist.get_rank(group)


def _shard_expert_weights(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if not isinstance(module, GroupedExperts):
        return
    size, rank = mesh.size(), mesh.get_local_rank()
    for param_name, param in list(module.named_parameters(recurse=False)):
        per_rank = param.shape[0] // size
        # Each rank slices its own copy (no communication): every rank built the same model from the
        # same seed, or is on the meta device and will be initialised per expert by init_weights.
        local = param.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _as_mesh(ep_mesh) -> DeviceMesh:
    if isinstance(ep_mesh, DeviceMesh):
        if ep_mesh.ndim != 1:
            raise ValueError(f"expert parallelism needs a 1-D mesh, got {ep_mesh.ndim} dimensions")
        return ep_mesh
    backend = dist.get_backend(ep_mesh)
    return DeviceMesh.from_group(ep_mesh, "cpu" if backend == "gloo" else "cuda")


def apply_expert_parallel(model: nn.Module, ep_mesh) -> nn.Module:
    """Shard every MoE layer's experts over `ep_mesh` (a 1-D DeviceMesh or a ProcessGroup) and route
    tokens to them with all-to-all. Works on a materialised model or on the meta device (then
    to_empty and init_weights, which initialise each rank's experts as one process would)."""
    mesh = _as_mesh(ep_mesh)
    group = mesh.get_group()
    layers = moe_layers(model)
    if not layers:
        raise ConfigError("ep", "expert parallelism needs MoE layers; set model.moe_every or model.moe_layers")
    for moe in layers:
        if moe.n_experts % mesh.size():
            raise ConfigError("ep", f"must divide model.n_experts={moe.n_experts}, got {mesh.size()}")
        dispatcher = _TokenDispatcher(group)
        distribute_module(
            moe.experts,
            mesh,
            partition_fn=_shard_expert_weights,
            input_fn=dispatcher.dispatch,
            output_fn=dispatcher.combine,
        )
        moe.gather_counts = lambda counts, group=group: _gather_counts(counts, group)
    return model
