"""DiLoCo: data-parallel replicas that communicate every H steps instead of every step.

Each replica takes H local optimizer steps (its own AdamW, no gradient all-reduce). Then the
pseudo-gradient, anchor - local weights (the anchor being the weights all replicas started the round
from), is averaged over the replicas, and an outer optimizer (SGD with Nesterov momentum) steps the
anchor with it; every replica continues from the new anchor (Douillard et al. 2023, "DiLoCo:
Distributed Low-Communication Training of Language Models", arXiv:2311.08105, Algorithm 1).

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512) splits the parameters into F fragments
of consecutive parameters that synchronise at staggered steps: fragment f after steps t with
t = f * H / F (mod H). Each fragment still syncs every H steps, but at most one fragment is sent per
step, so the peak communication is 1/F of the model.

Membership (join_timeout_s > 0): before each outer all-reduce the replicas check in through the
process group's store; the lowest surviving rank waits up to join_timeout_s for the others and
publishes who arrived, and the all-reduce runs over that set (a new gloo/NCCL group when it shrank).
A replica that dies during its inner steps is dropped and the others average among themselves. The
store lives in rank 0's process (torchrun's c10d store), so rank 0 itself cannot be dropped.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from kiln.errors import ConfigError

KEY_PREFIX = "kiln-diloco"
POLL_S = 0.01


class ReplicaDropped(RuntimeError):
    """This replica arrived after the others gave up waiting for it: it is no longer a member."""


def split_fragments(params: list[torch.Tensor], fragments: int) -> list[list[int]]:
    """Indices of `params` in `fragments` runs of consecutive parameters with about equal element
    counts (a fragment boundary goes where the running count passes k/F of the total)."""
    if fragments > len(params):
        raise ConfigError("outer_fragments", f"{fragments} fragments for a model of {len(params)} parameter tensors")
    total = sum(p.numel() for p in params)
    out: list[list[int]] = [[] for _ in range(fragments)]
    seen, f = 0, -1
    for i, p in enumerate(params):
        middle = (seen + p.numel() / 2) * fragments // total  # where the parameter's midpoint falls
        # Never skip a fragment, and leave at least one parameter for each one still to fill.
        f = int(max(min(middle, f + 1, fragments - 1), fragments - (len(params) - i)))
        out[f].append(i)
        seen += p.numel()
    return out


def fragments_due(step: int, outer_steps: int, fragments: int) -> list[int]:
    """The fragments whose round ends after inner step `step` (1-based): fragment f after the
    steps t = f * outer_steps / fragments (mod outer_steps)."""
    offset = outer_steps // fragments
    return [f for f in range(fragments) if step > 0 and (step - f * offset) % outer_steps == 0]


class DiLoCo:
    """The outer loop over `params` (the replica's trainable parameters, in a fixed order).

    `after_step(step, final)` is called after every inner optimizer step (step counted from 1);
    it synchronises the fragments due at that step (all of them when `final`)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        *,
        outer_steps: int,
        lr: float,
        momentum: float,
        nesterov: bool,
        fragments: int = 1,
        group=None,
        join_timeout_s: float = 0.0,
    ):
        if outer_steps % fragments:
            raise ValueError(f"outer_steps={outer_steps} is not a multiple of {fragments} fragments")
        self.params = list(params)
        self.outer_steps, self.fragments = outer_steps, fragments
        self.groups = split_fragments(self.params, fragments)
        self.anchor = [p.detach().clone().float() for p in self.params]
        self.outer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=nesterov)
        self.group = group
        self.members = sorted(
            dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        )
        self.join_timeout_s = join_timeout_s
        self.round = 0
        self.syncs = 0  # fragment synchronisations done (one all-reduce each)
        # Keys of an earlier torchrun attempt may still be in the store: each attempt has its own.
        self._prefix = f"{KEY_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def after_step(self, step: int, final: bool = False) -> list[int]:
        due = list(range(self.fragments)) if final else fragments_due(step, self.outer_steps, self.fragments)
        for f in due:
            self.sync(f)
        return due

    @torch.no_grad()
    def sync(self, fragment: int) -> None:
        """Average the fragment's pseudo-gradients over the members, step the anchor, reset to it."""
        members, group = self._join()
        index = self.groups[fragment]
        anchors = [self.anchor[i] for i in index]
        deltas = [a - self.params[i].detach().float() for a, i in zip(anchors, index)]
        flat = torch.cat([d.reshape(-1) for d in deltas])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)  # gloo has no AVG
        flat /= len(members)
        for a in self.anchor:
            a.grad = None  # the other fragments' anchors (and momenta) stay as they are
        for a, g in zip(anchors, torch.split(flat, [a.numel() for a in anchors])):
            a.grad = g.view_as(a)
        self.outer.step()
        for a, i in zip(anchors, index):
            a.grad = None
            self.params[i].copy_(a)
        self.syncs += 1

    def _join(self):
        """(members of this round, their process group). Without a timeout: the fixed group."""
        if self.join_timeout_s <= 0:
            return self.members, self.group
        store = dist.distributed_c10d._get_default_store()  # torch exposes the group's store only so
        rank, key = dist.get_rank(), f"{self._prefix}/{self.round}"
        self.round += 1
        store.set(f"{key}/{rank}", "1")
        if rank == self.members[0]:
            arrived, deadline = {rank}, time.monotonic() + self.join_timeout_s
            while len(arrived) < len(self.members) and time.monotonic() < deadline:
                arrived |= {r for r in self.members if r not in arrived and store.check([f"{key}/{r}"])}
                time.sleep(POLL_S)
            store.set(f"{key}/members", json.dumps(sorted(arrived)))
        members = json.loads(store.get(f"{key}/members"))
        if rank not in members:
            raise ReplicaDropped(
                f"replica {rank} reached outer round {self.round - 1} after the others left without it"
            )
        if members != self.members:
            self.members = members
            self.group = dist.new_group(members, use_local_synchronization=True)
        return self.members, self.group

    def state_dict(self) -> dict:
        return {
            "anchor": [a.detach().clone() for a in self.anchor],
            "outer": self.outer.state_dict(),
            "round": self.round,
            "syncs": self.syncs,
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["anchor"]) != len(self.anchor):
            raise ValueError(
                f"DiLoCo state has {len(state['anchor'])} anchors, the model {len(self.anchor)} parameters"
            )
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"]):
                a.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.round, self.syncs = state["round"], state["syncs"]
