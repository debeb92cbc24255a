"""Muon for the blocks' weight matrices, AdamW for everything else (train.optimizer = "muon").

Muon orthogonalises each matrix's momentum (Newton-Schulz iterations), which only means something
for the 2-D weights of hidden layers. Embedding tables (one row per token, sparse gradients), the
vocabulary head, norm gains and biases keep AdamW, as in Keller Jordan's Muon, modded-nanogpt and
nanochat. Both halves are torch's own optimizers (torch.optim.Muon, torch >= 2.9; torch.optim.AdamW);
MuonAdamW only joins them so the trainer's schedule, gradient scaler and checkpoints see one optimizer.

torch.optim.Muon runs its Newton-Schulz matmuls in bf16, whatever the device. A CPU without bf16
kernels (AVX2 only) runs those through a reference loop: one Muon step of a 17M-parameter model took
36 s there against 13 ms for fused AdamW (docs/benchmarks.md). `Muon` below is torch's optimizer with the
matmul dtype as a choice (train.muon_ns_dtype); in bf16 it is torch's own step, and its float32
step is the same algorithm (tests/train/test_muon.py checks it bit for bit against torch's in bf16).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from kiln.errors import ConfigError
from kiln.parallel.pipeline import StageLayers
from kiln.peft.adapter import adapter_modules
from kiln.peft.lora import lora_modules
from kiln.train.config import TrainConfig
from kiln.train.precision import cpu_bf16_is_fast

# Keller Jordan's and nanochat's peak Muon lr under the "original" shape scaling; with
# "match_rms_adamw" (Moonshot) the update RMS matches AdamW's, so AdamW's lr carries over.
DEFAULT_MUON_LR = 0.02


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], set[int]]:
    """The trainable parameters Muon takes: the 2-D weights inside the repeated blocks (the modules
    of any nn.ModuleList: `layers` in every Kiln model, a pipeline stage's StageLayers), embedding
    tables excepted. What lies outside the blocks (token embeddings, the vocabulary head, the final
    norm) stays with AdamW. Returns them in model order and their ids."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    chosen, seen = [], set()
    for block_list in (m for m in model.modules() if isinstance(m, (nn.ModuleList, StageLayers))):
        for p in block_list.parameters():
            if p.requires_grad and p.ndim == 2 and id(p) not in embedding_ids and id(p) not in seen:
                seen.add(id(p))
                chosen.append(p)
    return chosen, seen


def newton_schulz(update: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Muon's orthogonalised update: torch.optim.Muon's quintic Newton-Schulz iteration (Keller
    Jordan's coefficients), with its matmuls in `dtype`. The Gram matrix is taken on the short side."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_scale(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix lr factor: "original" (Keller Jordan) sqrt(max(1, rows / cols)), so that tall
    and wide matrices take updates of like RMS; "match_rms_adamw" (Moonshot) 0.2 sqrt(max(rows, cols)),
    which gives the update AdamW's RMS, so AdamW's lr carries over."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def orthogonalised_shard(update: DTensor, index: int, orthogonalise) -> DTensor:
    """Muon's update of one sharded matrix in a layout that orthogonalised_row_shards does not take
    (tensor parallelism, alone or under FSDP): Newton-Schulz needs the whole matrix, so its shards
    are gathered, one rank orthogonalises it and scatters each rank its shard;
    rank for rank the result is the single-process update of the whole matrix. distribute_tensor
    takes the source as a group rank on every mesh dimension, so the owner is the rank at coordinate
    (k, k, ...), with k = index mod the smallest dimension: the iterations' FLOPs turn round those
    ranks instead of being repeated on every one."""
    whole = update.full_tensor()
    mesh = update.device_mesh
    k = index % min(mesh.shape)
    owns = all(c == k for c in mesh.get_coordinate())
    # In the gradient's dtype on every rank, so the scatter's buffers agree (a bf16 iteration's
    # result widens to fp32 exactly, as it does when added to the weight).
    result = orthogonalise(whole).to(whole.dtype) if owns else torch.empty_like(whole)
    return distribute_tensor(result, mesh, update.placements, src_data_rank=k)


def row_sharded_dim(update: DTensor) -> int | None:
    """The mesh dimension over which `update` is split by rows, when that is its only split: FSDP's
    Shard(0), alone or beside HSDP's Replicate(). None for any other layout (tensor parallelism)."""
    shards = [i for i, p in enumerate(update.placements) if p == Shard(0)]
    rest_replicated = all(isinstance(p, Replicate) for i, p in enumerate(update.placements) if i not in shards)
    return shards[0] if len(shards) == 1 and rest_replicated else None


def _rows_per_rank(rows: int, world: int) -> list[int]:
    # Shard(0) splits rows as torch.chunk does: ceil(rows / world) each, the last ones short or empty.
    size = -(-rows // world)
    return [max(0, min(size, rows - r * size)) for r in range(world)]


def orthogonalised_row_shards(updates: list[DTensor], mesh_dim: int, orthogonalise) -> list[DTensor]:
    """Muon's updates of matrices split by rows over one mesh dimension (FSDP, HSDP), in rounds of
    as many matrices as that dimension has ranks: one all-to-all gives rank j the whole of the
    round's j-th matrix, rank j orthogonalises it, and a second all-to-all returns each rank its rows
    of every result. Two collectives per round, each moving a rank's own shards once, against a
    gather of every whole matrix to every rank and a scatter per matrix in orthogonalised_shard;
    the iterations' FLOPs are spread over all the shard ranks. HSDP's replicas (which hold the same
    gradients) each do the same in their own shard group, so no broadcast is needed. Rank for rank
    the result is the single-process update of each whole matrix."""
    mesh = updates[0].device_mesh
    group, world, rank = mesh.get_group(mesh_dim), mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    results = []
    for start in range(0, len(updates), world):
        batch = updates[start : start + world]
        locals_ = [u.to_local() for u in batch]
        row_numel = [math.prod(u.shape[1:]) for u in batch]
        splits = [_rows_per_rank(u.shape[0], world) for u in batch]
        for local, rows in zip(locals_, splits):
            if local.shape[0] != rows[rank]:  # a Shard(0) that did not split rows as torch.chunk does
                raise RuntimeError(f"muon: a shard of {local.shape[0]} rows where {rows[rank]} were expected")
        sent = [local.numel() for local in locals_] + [0] * (world - len(batch))
        owned = [r * row_numel[rank] for r in splits[rank]] if rank < len(batch) else [0] * world
        dtype, device = locals_[0].dtype, locals_[0].device
        whole = torch.empty(sum(owned), dtype=dtype, device=device)
        outgoing = torch.cat([local.reshape(-1) for local in locals_])
        dist.all_to_all_single(whole, outgoing, owned, sent, group=group)
        del outgoing  # at most a whole matrix and its result are held at once, as in orthogonalised_shard
        if rank < len(batch):
            # In the gradient's dtype, as in orthogonalised_shard (a bf16 result widens exactly).
            result = orthogonalise(whole.view(batch[rank].shape)).to(dtype).reshape(-1)
            del whole
        else:
            result = whole  # empty: this rank owns no matrix in a short last round
        incoming = torch.empty(sum(sent), dtype=dtype, device=device)
        dist.all_to_all_single(incoming, result.contiguous(), sent, owned, group=group)
        for update, local, piece in zip(batch, locals_, incoming.split(sent[: len(batch)])):
            shard = piece.view(local.shape)
            results.append(
                DTensor.from_local(shard, mesh, update.placements, shape=update.shape, stride=update.stride())
            )
    return results


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz matmuls in `ns_dtype`: torch's own step in bf16, and
    `step_in_dtype` (the same update, written out) otherwise and for sharded matrices (DTensors,
    orthogonalised whole by orthogonalised_row_shards or orthogonalised_shard). The state (one momentum buffer per matrix) and
    param_groups are torch's, so a checkpoint resumes under either dtype."""

    def __init__(self, params, *, ns_dtype: torch.dtype, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.sharded = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == torch.bfloat16 and not self.sharded:
            return super().step(closure)
        return self.step_in_dtype(closure)

    def orthogonaliser(self, group: dict):
        """The Newton-Schulz iteration a step applies to `group`'s matrices (its coefficients, steps
        and eps, torch's defaults unless set), in ns_dtype."""

        def orthogonalise(x: torch.Tensor) -> torch.Tensor:
            return newton_schulz(x, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)

        return orthogonalise

    @torch.no_grad()
    def step_in_dtype(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            momentum = group["momentum"]
            orthogonalise = self.orthogonaliser(group)

            def apply(p, update, group=group):
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * lr_scale(group["adjust_lr_fn"], p.shape))

            # Row-sharded matrices wait for one batched exchange per (mesh, dim, dtype); each
            # matrix's update is independent of the others', so the order they land in is free.
            row_sharded: dict[tuple, list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                if isinstance(update, DTensor):
                    mesh_dim = row_sharded_dim(update)
                    if mesh_dim is not None:
                        row_sharded.setdefault((update.device_mesh, mesh_dim, update.dtype), []).append((p, update))
                        continue
                    update = orthogonalised_shard(update, index, orthogonalise)
                    index += 1
                else:
                    update = orthogonalise(update)
                apply(p, update)
            for (_, mesh_dim, _), pairs in row_sharded.items():
                params, updates = zip(*pairs)
                for p, update in zip(params, orthogonalised_row_shards(list(updates), mesh_dim, orthogonalise)):
                    apply(p, update)
        return loss


def ns_dtype(cfg: TrainConfig, device_type: str) -> torch.dtype:
    """train.muon_ns_dtype; auto: bf16 (torch's choice) except on a CPU whose bf16 matmuls are not
    faster than fp32's (kiln.train.precision's probe, the one train.precision = "auto" uses)."""
    if cfg.muon_ns_dtype != "auto":
        return getattr(torch, cfg.muon_ns_dtype)
    return torch.float32 if device_type == "cpu" and not cpu_bf16_is_fast() else torch.bfloat16


class MuonAdamW:
    """torch.optim.Muon over `muon_params` and torch.optim.AdamW over `adamw_groups`.

    param_groups lists both optimizers' groups (Muon's first); each Muon group carries "lr_ratio"
    (muon_lr / lr), which the trainer multiplies into the scheduled lr, so Muon's lr follows the
    same warmup and decay from its own peak. state_dict() nests the two optimizers' own dicts.
    """

    def __init__(self, muon_params, adamw_groups, *, muon_kwargs: dict, adamw_kwargs: dict, lr_ratio: float):
        self.muon = Muon([{"params": muon_params, "lr_ratio": lr_ratio}], **muon_kwargs)
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw_kwargs)

    @property
    def param_groups(self) -> list[dict]:
        """Both optimizers' groups, read from them on every access: loading a state (ours, or DCP's
        set_optimizer_state_dict on each part) replaces their group dicts, and a list kept from before
        would take the trainer's scheduled lr without the optimizers seeing it. GradScaler's
        unscale_/step key their records by id(self) and read only param_groups."""
        return self.muon.param_groups + self.adamw.param_groups

    def step(self, closure=None):
        loss = self.muon.step(closure)  # the closure (if any) is evaluated once, by Muon
        self.adamw.step()
        return loss

    @property
    def parts(self) -> dict[str, torch.optim.Optimizer]:
        """The joined optimizers by the names state_dict() nests them under (for the sharded
        checkpoints of kiln.checkpoint.sharded and the layouts' loading of a single-file state)."""
        return {"muon": self.muon, "adamw": self.adamw}

    @property
    def state(self) -> dict:
        """Each parameter's state, from whichever optimizer steps it (what readers of a torch
        optimizer's `state` expect, e.g. kiln.train.memcheck)."""
        return {**self.muon.state, **self.adamw.state}

    def register_step_pre_hook(self, hook):
        return self.muon.register_step_pre_hook(hook)  # Muon's step runs first: before any update

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ConfigError("optimizer", "the checkpoint's optimizer state was not written by optimizer = 'muon'")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_muon(model: nn.Module, groups: list[dict], cfg: TrainConfig, foreach: bool) -> MuonAdamW:
    """Muon over muon_split(model); the rest of `groups` (kiln.train.optim.param_groups) to AdamW."""
    if lora_modules(model) or adapter_modules(model):
        raise ConfigError("optimizer", "muon trains full weight matrices; LoRA and adapters (peft) train with adamw")
    muon_params, muon_ids = muon_split(model)
    if not muon_params:
        raise ConfigError("optimizer", "muon: the model has no trainable 2-D block matrices")
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in muon_ids]} for g in groups]
    rest = [g for g in rest if g["params"]]
    if not rest:
        raise ConfigError("optimizer", "muon: no embedding, head or norm parameters left for AdamW")
    muon_lr = cfg.muon_lr or (DEFAULT_MUON_LR if cfg.muon_adjust_lr == "original" else cfg.lr)
    return MuonAdamW(
        muon_params,
        rest,
        muon_kwargs=dict(
            lr=muon_lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            ns_steps=cfg.muon_ns_steps,
            adjust_lr_fn=cfg.muon_adjust_lr,
            ns_dtype=ns_dtype(cfg, muon_params[0].device.type),
        ),
        adamw_kwargs=dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        | ({"fused": True} if cfg.optimizer_impl == "fused" else {"foreach": foreach}),
        lr_ratio=muon_lr / cfg.lr,
    )
