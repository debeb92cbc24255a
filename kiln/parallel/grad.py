"""Gradient-norm clipping that is correct when parameters live on different meshes.

`torch.nn.utils.clip_grad_norm_` stacks the per-parameter norms into one tensor, which fails when
some gradients are DTensors on a 2-D (dp, tp) mesh and others on the dp mesh only. Here the norms are
computed per group of gradients that share a mesh and layout, each group's norm is materialised as a
plain tensor (the DTensor reduction does the cross-rank sum of squares), and the groups are combined;
pipeline stages hold disjoint parameters, so their squared norms are summed over the pp group.
"""

from __future__ import annotations

import math

import torch


def _by_layout(grads) -> dict[object, list[torch.Tensor]]:
    """Gradients grouped by (mesh, placements): DTensor ops refuse to mix meshes."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    return groups


def total_grad_norm(params, pp_group=None) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    squares = []
    for members in _by_layout(grads).values():
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_grad_norm(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """Scale gradients so their global 2-norm is at most max_norm; returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    norm = total_grad_norm(params, pp_group)
    if math.isfinite(max_norm):
        # The same rule as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), capped at 1.
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for members in _by_layout(p.grad for p in params).values():
            torch._foreach_mul_(members, coef.to(members[0].device))
    return norm
