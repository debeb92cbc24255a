"""Context parallelism: one long sequence split across ranks, attention exchanging keys and values.

Every layer except attention acts on each token alone, so a rank holding a slice of the sequence
runs embeddings, norms, FFNs and the loss on its slice unchanged. Only attention needs the other
ranks' keys and values. `apply_context_parallel` swaps each `Attention.attention` for one that gets
them, and `shard_sequence` gives each rank its tokens, targets and global positions (RoPE reads the
global position, so rotated q/k match the full-sequence run exactly).

Three attention backends:
- "ring" (Kiln's, any device and process-group backend, the default unless the group is NCCL): each
  rank keeps its queries and passes its key/value block around the ring with point-to-point
  send/recv, one hop per step, overlapping the transfer of the next block with the attention on the current one. Partial
  results are merged with a running max and sum (online softmax), so a rank never holds more than
  two key/value blocks. The backward pass rotates the blocks again, and the key/value gradients
  travel with their block until they arrive back at its owner.
- "allgather" (Kiln's): all-gather the whole sequence's keys and values, then one masked SDPA.
  Fewer, larger messages, but every rank holds the full K/V and the mask is materialised.
- "torch" (the default on an NCCL group, i.e. CUDA): PyTorch's experimental context-parallel SDPA
  (`torch.distributed.tensor.experimental._attention._ContextParallel`), which dispatches the CUDA
  flash / memory-efficient / cuDNN kernels to ring attention. It has no CPU training path (no
  sharding rule for the CPU flash kernel, and flex attention has no CPU backward), so it cannot be
  tested on a CPU-only machine.

Load balancing ("head-tail"/zigzag, the layout PyTorch's `_HeadTailLoadBalancer` uses): the sequence
is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r, so every rank has the same number of
unmasked (query, key) pairs under the causal mask. Without it, rank r holds chunk r of cp and the
last rank does cp times the attention work of the first.

Gradients: each rank back-propagates the mean loss over its own tokens. Those losses are equal-sized
slices of the full-sequence mean, so the full-sequence gradient is the *average* of the ranks'
parameter gradients (FSDP over the flattened dp_shard x cp mesh does exactly that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.model.transformer import Attention

BACKENDS = ("auto", "ring", "allgather", "torch")


# ---------------------------------------------------------------------------------------------
# Layout: which global positions each rank holds
# ---------------------------------------------------------------------------------------------


def _check_divisible(seq_len: int, cp_size: int, load_balance: bool) -> None:
    parts = 2 * cp_size if load_balance else cp_size
    if seq_len % parts:
        how = "2*cp (load balancing cuts it into 2*cp chunks)" if load_balance else "cp"
        raise ConfigError("parallel.cp", f"the sequence length {seq_len} must be divisible by {how} = {parts}")


def sequence_pieces(seq_len: int, cp_rank: int, cp_size: int, load_balance: bool) -> list[tuple[int, int, int]]:
    """The contiguous runs of the global sequence that `cp_rank` holds, as
    (start in the local slice, start in the global sequence, length), in local order."""
    _check_divisible(seq_len, cp_size, load_balance)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp_size - 1}")
    if not load_balance:
        n = seq_len // cp_size
        return [(0, cp_rank * n, n)]
    c = seq_len // (2 * cp_size)
    return [(0, cp_rank * c, c), (c, (2 * cp_size - 1 - cp_rank) * c, c)]


def sequence_positions(seq_len: int, cp_rank: int, cp_size: int, load_balance: bool = True) -> torch.Tensor:
    """Global positions [seq_len // cp_size] held by `cp_rank`, in local order."""
    return torch.cat([torch.arange(g, g + n) for _, g, n in sequence_pieces(seq_len, cp_rank, cp_size, load_balance)])


def shard_sequence(
    inputs: torch.Tensor, targets: torch.Tensor | None, cp_rank: int, cp_size: int, load_balance: bool = True
):
    """This rank's share of a [B, T] batch: (local_inputs, local_targets, position_ids), each [B, T/cp].

    `targets` are the next-token targets already aligned with `inputs` (targets[:, t] follows
    inputs[:, t]), so slicing both at the same positions keeps every (token, target) pair whole and
    the loss over a rank's tokens is a slice of the full-sequence loss."""
    positions = sequence_positions(inputs.shape[1], cp_rank, cp_size, load_balance).to(inputs.device)
    local_targets = None if targets is None else targets[:, positions]
    return inputs[:, positions], local_targets, positions.expand(inputs.shape[0], -1)


def pair_mask(q_piece: tuple[int, int, int], k_piece: tuple[int, int, int], device=None):
    """How queries of one run attend to keys of another under the causal mask, by global position:
    "skip" (no key visible), None (every key visible) or a bool [Lq, Lk] mask (True = attend)."""
    _, qg, qn = q_piece
    _, kg, kn = k_piece
    if kg > qg + qn - 1:
        return "skip"
    if kg + kn - 1 <= qg:
        return None
    q_pos = torch.arange(qg, qg + qn, device=device)
    k_pos = torch.arange(kg, kg + kn, device=device)
    return k_pos[None, :] <= q_pos[:, None]


# ---------------------------------------------------------------------------------------------
# Ring attention math, per (query run, key run) pair. Shapes: q5 [B, KV, G, Lq, hd] (query head
# kv*G + j reads key/value head kv, the model's GQA order), k and v [B, KV, Lk, hd]; float32.
# ---------------------------------------------------------------------------------------------


def _scores(q5, k, mask, scale):
    s = (q5 @ k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def attend_pair(q5, k, v, mask, scale, m, l, acc) -> None:
    """Fold one key/value run into the running max m, sum l [.., Lq] and unnormalised output acc
    [.., Lq, hd] of a query run (all updated in place)."""
    s = _scores(q5, k, mask, scale)
    m_new = torch.maximum(m, s.amax(-1))
    # A row with no visible key so far would give exp(-inf - -inf) = nan; a finite floor makes both
    # factors below exp(-inf) = 0 instead. (Runs are whole chunks, so it cannot happen in practice.)
    m_safe = m_new.clamp_min(torch.finfo(m_new.dtype).min)
    p = torch.exp(s - m_safe.unsqueeze(-1))
    alpha = torch.exp(m - m_safe)
    l.mul_(alpha).add_(p.sum(-1))
    acc.mul_(alpha.unsqueeze(-1)).add_(p @ v.unsqueeze(2))
    m.copy_(m_new)


def pair_grads(q5, k, v, do5, lse, delta, mask, scale):
    """Gradients of one (query run, key run) pair given the final log-sum-exp and
    delta = rowsum(dO * O): returns (dq5, dk, dv) for the two runs."""
    p = torch.exp(_scores(q5, k, mask, scale) - lse.unsqueeze(-1))
    dv = (p.transpose(-1, -2) @ do5).sum(2)
    dp = do5 @ v.unsqueeze(2).transpose(-1, -2)
    ds = p * (dp - delta.unsqueeze(-1))
    dq5 = (ds @ k.unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ q5).sum(2) * scale
    return dq5, dk, dv


@dataclass
class _Ring:
    """The cp group as the ring sees it: this rank, its neighbours' global ranks, the layout."""

    group: object
    load_balance: bool
    rank: int = field(init=False)
    size: int = field(init=False)
    next_rank: int = field(init=False)
    prev_rank: int = field(init=False)

    def __post_init__(self):
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.next_rank = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev_rank = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def pieces(self, rank: int, local_len: int):
        return sequence_pieces(local_len * self.size, rank, self.size, self.load_balance)

    def shift(self, tensor: torch.Tensor):
        """Start sending `tensor` to the next rank and receiving the previous rank's: (buffer, works)."""
        if self.size == 1:
            return tensor, []
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next_rank, self.group),
            dist.P2POp(dist.irecv, received, self.prev_rank, self.group),
        ]
        return received, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


def _pairs(ring: _Ring, src: int, local_len: int, device):
    """Every (query slice, key slice, mask) of this rank's queries against `src`'s keys that has a
    visible key; fully masked pairs are skipped, which is where load balancing pays off."""
    for q_piece in ring.pieces(ring.rank, local_len):
        for k_piece in ring.pieces(src, local_len):
            mask = pair_mask(q_piece, k_piece, device)
            if isinstance(mask, str):
                continue
            yield slice(q_piece[0], q_piece[0] + q_piece[2]), slice(k_piece[0], k_piece[0] + k_piece[2]), mask


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        batch, heads, length, hd = q.shape
        kv_heads = k.shape[1]
        scale = 1.0 / math.sqrt(hd)
        q5 = q.float().view(batch, kv_heads, heads // kv_heads, length, hd)
        m = torch.full(q5.shape[:-1], float("-inf"), device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q5)
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.size):
            if step + 1 < ring.size:
                incoming, works = ring.shift(kv)
            src = (ring.rank - step) % ring.size
            kf, vf = kv.float().unbind(0)
            for qs, ks, mask in _pairs(ring, src, length, q.device):
                attend_pair(
                    q5[..., qs, :], kf[..., ks, :], vf[..., ks, :], mask, scale, m[..., qs], l[..., qs], acc[..., qs, :]
                )
            if step + 1 < ring.size:
                _wait(works)
                kv = incoming
        out = (acc / l.unsqueeze(-1)).view(batch, heads, length, hd).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, m + l.log())
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        batch, heads, length, hd = q.shape
        kv_heads = k.shape[1]
        shape5 = (batch, kv_heads, heads // kv_heads, length, hd)
        q5 = q.float().view(shape5)
        do5 = grad_out.float().reshape(shape5)
        delta = (do5 * out.float().view(shape5)).sum(-1)
        dq5 = torch.zeros_like(q5)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(ring.size):
            if step + 1 < ring.size:
                incoming, works = ring.shift(kv)
            src = (ring.rank - step) % ring.size
            kf, vf = kv.float().unbind(0)
            for qs, ks, mask in _pairs(ring, src, length, q.device):
                dq, dk, dv = pair_grads(
                    q5[..., qs, :],
                    kf[..., ks, :],
                    vf[..., ks, :],
                    do5[..., qs, :],
                    lse[..., qs],
                    delta[..., qs],
                    mask,
                    scale,
                )
                dq5[..., qs, :] += dq
                dkv[0, ..., ks, :] += dk
                dkv[1, ..., ks, :] += dv
            # The gradient of block `src` moves on with it; after the last step it reaches its owner.
            outgoing = dkv  # kept alive until its send completes
            dkv, dkv_works = ring.shift(outgoing)
            if step + 1 < ring.size:
                _wait(works)
                kv = incoming
            _wait(dkv_works)
        return dq5.view(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


# ---------------------------------------------------------------------------------------------
# All-gather attention
# ---------------------------------------------------------------------------------------------

# torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim -2 in rank order. Every rank's output depends on every rank's input, so
    the input gradient is the sum over ranks of their output gradients' slice for this rank: a
    reduce-scatter (which gloo runs as all-reduce + slice). The gradient is made contiguous first:
    gloo collectives given non-contiguous tensors return wrong values, which is why
    torch.distributed.nn.functional.all_gather is not used."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        # [d0, ..., size * n, hd] -> [size * d0, ..., n, hd]: reduce_scatter_tensor hands rank r the
        # r-th block of dim 0 (gloo insists that dim 0 itself be size times the output's).
        stacked = grad.unflatten(-2, (size, -1)).movedim(-3, 0).contiguous()
        out = torch.empty(stacked.shape[1:], dtype=grad.dtype, device=grad.device)
        _reduce_scatter(out, stacked.flatten(0, 1), group=ctx.group)
        return out, None


class ContextParallelAttention:
    """Drop-in for `causal_attention` on a cp rank: q [B, H, T/cp, hd], k/v [B, KV, T/cp, hd] hold this
    rank's share of the sequence (as laid out by `shard_sequence`); returns this rank's output."""

    def __init__(self, group, load_balance: bool, backend: str):
        self.group, self.load_balance, self.backend = group, load_balance, backend
        self._ring = _Ring(group, load_balance) if backend == "ring" else None

    def __repr__(self) -> str:
        return f"ContextParallelAttention(backend={self.backend!r}, load_balance={self.load_balance})"

    # Communication and a custom autograd Function: run eagerly even inside a compiled block.
    @torch.compiler.disable
    def __call__(self, q, k, v, enable_gqa: bool = False):
        if self.backend == "ring":
            return _RingAttention.apply(q, k, v, self._ring)
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        length = q.shape[2]
        k_all, v_all = _GatherSequence.apply(torch.stack([k, v]), self.group).unbind(0)
        q_pos = sequence_positions(length * size, rank, size, self.load_balance).to(q.device)
        k_pos = torch.cat([sequence_positions(length * size, r, size, self.load_balance) for r in range(size)]).to(
            q.device
        )
        mask = k_pos[None, :] <= q_pos[:, None]
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=enable_gqa)


# ---------------------------------------------------------------------------------------------
# PyTorch's context parallel (CUDA only)
# ---------------------------------------------------------------------------------------------


class _CausalSDPA(nn.Module):
    """The module PyTorch's `_ContextParallel` style hooks: its tensor inputs become sequence-sharded
    DTensors, and DTensor dispatches the CUDA SDPA kernels to PyTorch's ring attention."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _TorchContextParallelAttention(nn.Module):
    def __init__(self, mesh):
        super().__init__()
        from torch.distributed.tensor.experimental._attention import _ContextParallel
        from torch.distributed.tensor.parallel import parallelize_module

        self.sdpa = parallelize_module(
            _CausalSDPA(), mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
        )

    def forward(self, q, k, v, enable_gqa: bool = False):
        if enable_gqa:
            # PyTorch's ring SDPA handlers take no enable_gqa; expanding the shared heads here (plain
            # tensors, before the DTensor hook) is always correct, at the cost of the repeated copies.
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self.sdpa(q, k, v)


def _torch_attention_factory(mesh, load_balance: bool):
    try:
        from torch.distributed.tensor.experimental._attention import (
            _ContextParallel,
            _cp_options,
            _enable_context_parallel_dispatcher,
            set_rotate_method,
        )

        del _ContextParallel  # only checked here: _TorchContextParallelAttention imports it
    except ImportError as exc:
        raise ConfigError(
            "parallel.cp_backend",
            f"'torch' needs PyTorch's experimental context parallel "
            f"(_ContextParallel), which torch {torch.__version__} lacks ({exc}); use 'ring'",
        ) from exc
    # Process-wide switches of PyTorch's implementation: its causal ring must assume the same layout
    # that shard_sequence produced, and "alltoall" passes K/V one hop per step (a ring) instead of
    # gathering the whole sequence at once.
    _cp_options.enable_load_balance = load_balance
    set_rotate_method("alltoall")
    _enable_context_parallel_dispatcher()
    return lambda: _TorchContextParallelAttention(mesh)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def _resolve(cp_group_or_mesh):
    """(process group, 1-D DeviceMesh or None) from either."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(cp_group_or_mesh, DeviceMesh):
        if cp_group_or_mesh.ndim != 1:
            raise ValueError(f"context parallelism needs a 1-D cp mesh, got dims {cp_group_or_mesh.mesh_dim_names}")
        return cp_group_or_mesh.get_group(), cp_group_or_mesh
    return cp_group_or_mesh if cp_group_or_mesh is not None else dist.group.WORLD, None


def apply_context_parallel(
    model: nn.Module, cp_group_or_mesh, load_balance: bool = True, backend: str = "auto"
) -> nn.Module:
    """Replace the attention of every `Attention` module in `model` with a context-parallel one over
    `cp_group_or_mesh` (a process group or 1-D DeviceMesh). Feed each rank `shard_sequence(...)` of
    the batch with the same `load_balance`, and pass its position_ids to the model.

    backend: "auto" ("torch" on an NCCL group, else "ring"), "ring", "allgather" or "torch"."""
    if backend not in BACKENDS:
        raise ConfigError("parallel.cp_backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    scaling = getattr(getattr(model, "cfg", None), "rope_scaling", None)
    if scaling is not None and scaling.type == "dynamic":
        # Dynamic NTK's frequencies follow the longest position of the forward, which each rank's
        # share of the sequence would see differently.
        raise ConfigError("model.rope_scaling.type", "'dynamic' cannot train with context parallelism; use yarn")
    group, mesh = _resolve(cp_group_or_mesh)
    # Decided by the process group, not the parameters: a model may still be on the meta device here.
    nccl = dist.get_backend(group) == "nccl"
    if backend == "auto":
        backend = "torch" if nccl else "ring"
    if backend == "torch":
        if not nccl:
            raise ConfigError(
                "parallel.cp_backend",
                "'torch' (PyTorch's context parallel) trains only on CUDA "
                f"with NCCL, the cp group uses {dist.get_backend(group)!r}; use 'ring' or 'allgather'",
            )
        if mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(group, "cuda")
        make = _torch_attention_factory(mesh, load_balance)
    else:
        shared = ContextParallelAttention(group, load_balance, backend)  # stateless between calls

        def make():
            return shared

    # Listed first: the torch backend registers a submodule on each Attention while we walk them.
    for module in [m for m in model.modules() if isinstance(m, Attention)]:
        module.attention = make()
    return model
