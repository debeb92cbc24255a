"""Pipeline parallelism: the plain Transformer split by layers into stages, run by PyTorch's
schedules (torch.distributed.pipelining), in torchtitan's manner: stages are cut from the model
from outside, by hand, with no tracer.

A stage is a small module that borrows the model's own submodules under the same attribute names
(`tok_embeddings`, `layers.<i>`, `norm`, `output`), so every parameter keeps the name it has in
the unsplit model: a checkpoint saved under any pipeline layout loads into any other, or into one
process. Only the first stage embeds tokens and only the last applies the final norm and the head;
every stage reads the RoPE tables from the model's buffers.

Loss and gradients equal the single-process ones of the mean loss over the whole batch: the last
stage takes the mean cross-entropy of each microbatch, the schedule sums the microbatch gradients
and divides them by the microbatch count (`scale_grads=True`), and the microbatches have equal
size, so the mean of microbatch means is the batch mean. MoE auxiliary losses, which arise in
every stage but reach no loss function, enter backward through `_AuxLossGradient`, and each stage
keeps their values so that the logged training loss holds the same terms as without a pipeline:
a rank's training step returns its share (cross-entropy on the last stage, plus the mean auxiliary
loss of its own stages), and the sum of the shares over the pp ranks is the batch's loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.model.moe import moe_aux_loss
from kiln.model.rope import rotation
from kiln.model.transformer import Transformer, flops_per_token
from kiln.parallel.config import PP_SCHEDULES, ParallelConfig


class StageLayers(nn.Module):
    """The blocks a stage owns, registered under their index in the whole model.

    It reads like the model's `ModuleList` (iterate, `len`, `[position]`, `[position] = module`), so
    code that walks `model.layers` (tensor parallelism, activation checkpointing, compile, FSDP)
    works on a stage unchanged, while the registered names stay "3", "4", ... rather than "0",
    "1": that is what keeps parameter names equal to the unsplit model's.
    """

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        self.indices = sorted(blocks)
        for index in self.indices:
            self.add_module(str(index), blocks[index])

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        return (self._modules[str(index)] for index in self.indices)

    def __getitem__(self, position: int) -> nn.Module:
        return self._modules[str(self.indices[position])]

    def __setitem__(self, position: int, module: nn.Module) -> None:
        setattr(self, str(self.indices[position]), module)


class _AuxLossGradient(torch.autograd.Function):
    """Identity on the stage output whose backward also starts the backward of `aux`.

    The schedule backpropagates only from the last stage's loss, so the MoE load-balance and
    z-losses of earlier stages (and of the last stage's blocks) would otherwise get no gradient.
    Giving `aux` the gradient 1 when the output's gradient arrives adds d(aux)/d(params) once per
    microbatch; the schedule's division by the microbatch count then makes it the mean over
    microbatches, as gradient accumulation over the same microbatches does (Megatron-LM attaches
    its MoE auxiliary loss the same way).
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux)


class PipelineStageModule(nn.Module):
    """One pipeline stage of a Transformer: tokens [B, T] -> hidden [B, T, dim] on the first stage,
    hidden -> hidden in the middle, hidden -> logits [B, T, vocab] on the last (a single stage does
    all of it and equals the model)."""

    def __init__(self, model: Transformer, layer_ids: range, stage_index: int, num_stages: int):
        super().__init__()
        cfg = model.cfg
        self.cfg = cfg
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        if self.is_first:
            self.tok_embeddings = model.tok_embeddings
            if cfg.pos == "learned":
                self.pos_embeddings = model.pos_embeddings
            elif cfg.pos == "sinusoidal":
                self.register_buffer("pos_table", model.pos_table, persistent=False)
        self.layers = StageLayers({i: model.layers[i] for i in layer_ids})
        if cfg.pos == "rope":
            # The model's tensors themselves, not copies: stages on one rank share a single table.
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        if self.is_last:
            self.norm = model.norm
            self.output = model.output
        # The MoE auxiliary loss of each forward run with grad (detached), read by the training step.
        self.aux_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        if self.is_first:
            if seq > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {seq} exceeds model max_seq_len={self.cfg.max_seq_len}")
            h = self.tok_embeddings(x)
            if self.cfg.pos == "learned":
                h = h + self.pos_embeddings(torch.arange(seq, device=x.device))
            elif self.cfg.pos == "sinusoidal":
                h = h + self.pos_table[:seq]
        else:
            h = x
        cos = sin = None
        if self.cfg.pos == "rope":
            cos, sin = rotation(self.cfg, self.rope_cos, self.rope_sin, slice(0, seq), seq)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            if torch.is_autocast_enabled(h.device.type):
                # Same rule as Transformer.forward, so a split model computes what the whole one does.
                dtype = torch.get_autocast_dtype(h.device.type)
                cos, sin = cos.to(dtype), sin.to(dtype)
        for block in self.layers:
            h = block(h, cos, sin)
        aux = moe_aux_loss(self.layers)
        if aux is not None and torch.is_grad_enabled():
            h = _AuxLossGradient.apply(h, aux)
            self.aux_losses.append(aux.detach())
        if not self.is_last:
            return h
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)  # through the module, as Transformer.forward, so a parallelised head applies


def head_weight_from_flops(cfg) -> float:
    """The output head's cost in units of one block: its matmul (dim x vocab per token) against a
    block's weight matmuls plus attention, from the same FLOP count the trainer uses for MFU. For
    a toy vocabulary it is a fraction of a layer; for Llama-3 8B (vocab 128k, dim 4096, 8k context)
    it is about 1.8 layers, so the last stage should get about two blocks fewer than the others."""
    head = 6.0 * cfg.vocab_size * cfg.dim
    per_layer = (flops_per_token(cfg, cfg.max_seq_len) - head) / cfg.n_layers
    return head / per_layer


def split_layers(n_layers: int, n_stages: int, embed_weight: float = 0.0, head_weight: float = 0.0) -> list[range]:
    """Contiguous blocks per stage, balancing each stage's cost: its block count, plus
    `embed_weight` on the first stage and `head_weight` on the last (in units of one block).

    Every stage gets one block, then each further block goes to the stage whose cost is lowest at
    that moment (the earlier stage on a tie). Adding unit costs to the current minimum gives the
    smallest possible maximum stage cost, which is what sets a pipeline's step time.
    """
    if n_layers < n_stages:
        raise ConfigError(
            "parallel.pp",
            f"{n_stages} pipeline stages (pp x pp_stages_per_rank) need at least "
            f"as many layers, but model.n_layers = {n_layers}",
        )
    counts = [1] * n_stages
    extra = [0.0] * n_stages
    extra[0] += embed_weight
    extra[-1] += head_weight
    for _ in range(n_layers - n_stages):
        cheapest = min(range(n_stages), key=lambda s: (counts[s] + extra[s], s))
        counts[cheapest] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_ids_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """Loop placement: rank r runs stages r, r + pp, r + 2 pp, ... (what PyTorch's interleaved
    schedules expect), so the activations go round the ranks `stages_per_rank` times."""
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def split_model(
    model: Transformer,
    pp_rank: int,
    pp_size: int,
    stages_per_rank: int = 1,
    *,
    embed_weight: float = 0.0,
    head_weight: float | None = None,
) -> list[PipelineStageModule]:
    """The stages `pp_rank` runs, in the order of their stage index.

    The stages share their modules with `model`; blocks other ranks own stay referenced only by
    `model`, so dropping `model` afterwards frees them. The embedding lookup does no matmul, so its
    default weight is 0; the head's default (None) is its FLOP cost (`head_weight_from_flops`).
    Uneven splits are allowed: pp need not divide n_layers.
    """
    cfg = model.cfg
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    n_stages = pp_size * stages_per_rank
    if n_stages > 1 and cfg.tie_embeddings:
        # The first and last stages live on different ranks, so one tied matrix would need its
        # gradient summed across them; Kiln keeps the head separate instead.
        raise ConfigError(
            "model.tie_embeddings",
            "pipeline parallelism (parallel.pp > 1) needs untied "
            "embeddings: the embedding and the head are on different ranks",
        )
    if head_weight is None:
        head_weight = head_weight_from_flops(cfg)
    ranges = split_layers(cfg.n_layers, n_stages, embed_weight, head_weight)
    return [
        PipelineStageModule(model, ranges[s], s, n_stages) for s in stage_ids_of_rank(pp_rank, pp_size, stages_per_rank)
    ]


class PipelineParts(nn.Module):
    """All of one rank's stages as one module with the unsplit model's parameter names: the module
    the optimizer, gradient clipping and checkpoints see (the stages themselves run forward)."""

    def __init__(self, stages: list[PipelineStageModule]):
        super().__init__()
        self.cfg = stages[0].cfg
        blocks = {}
        for stage in stages:
            blocks.update({i: stage.layers._modules[str(i)] for i in stage.layers.indices})
            for name in ("tok_embeddings", "pos_embeddings", "norm", "output"):
                module = getattr(stage, name, None)
                if isinstance(module, nn.Module):
                    setattr(self, name, module)
        self.layers = StageLayers(blocks)


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one microbatch, in float32 like the trainer's loss."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _pp_group(pp_group_or_mesh):
    if pp_group_or_mesh is None:
        return None  # the default (world) group
    names = getattr(pp_group_or_mesh, "mesh_dim_names", None)
    if names is not None:  # a DeviceMesh: its "pp" dimension, or the mesh itself when 1-D
        mesh = pp_group_or_mesh["pp"] if "pp" in names and len(names) > 1 else pp_group_or_mesh
        return mesh.get_group()
    return pp_group_or_mesh


def build_pipeline_schedule(
    stages: list[PipelineStageModule],
    pp_group_or_mesh,
    cfg: ParallelConfig,
    loss_fn=pipeline_loss,
    device: torch.device | str = "cpu",
    scale_grads: bool = True,
):
    """Wrap this rank's stages in `PipelineStage`s and return the schedule `cfg.pp_schedule` names,
    running `cfg.microbatches` microbatches per step.

    Shapes are inferred at the first step (sent stage to stage), so every later step must use the
    same batch shape. Gradients are divided by the microbatch count (scale_grads=True), which with a
    per-microbatch mean loss gives the gradient of the mean loss over the whole batch. That division
    applies to whatever the .grad tensors hold, so a caller that accumulates several schedule steps
    into one optimizer step passes scale_grads=False and divides once itself.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if cfg.pp_schedule not in PP_SCHEDULES:
        raise ConfigError("parallel.pp_schedule", f"must be one of {', '.join(PP_SCHEDULES)}, got {cfg.pp_schedule!r}")
    if len(stages) != cfg.pp_stages_per_rank:
        raise ConfigError(
            "parallel.pp_stages_per_rank",
            f"is {cfg.pp_stages_per_rank} but this rank was given "
            f"{len(stages)} stages; split the model with the same stages_per_rank",
        )
    if cfg.pp_schedule != "interleaved_1f1b" and len(stages) != 1:
        raise ConfigError(
            "parallel.pp_schedule",
            f"{cfg.pp_schedule} runs one stage per rank; use 'interleaved_1f1b' for pp_stages_per_rank > 1",
        )
    m = cfg.microbatches
    if cfg.pp_schedule == "interleaved_1f1b":
        # PyTorch runs interleaved 1F1B in rounds of pp microbatches each (fewer when m < pp).
        rounds = max(1, m // cfg.pp)
        if m % rounds:
            raise ConfigError(
                "parallel.pp_microbatches",
                f"interleaved_1f1b needs a multiple of {rounds} microbatches (rounds of pp = {cfg.pp}), got {m}",
            )
    device = torch.device(device)
    group = _pp_group(pp_group_or_mesh)
    pipeline_stages = [
        PipelineStage(stage, stage.stage_index, stage.num_stages, device, group=group) for stage in stages
    ]
    if cfg.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(pipeline_stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=scale_grads)
    schedule_class = ScheduleGPipe if cfg.pp_schedule == "gpipe" else Schedule1F1B
    return schedule_class(pipeline_stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=scale_grads)


def _check_batch(schedule, tensor: torch.Tensor) -> None:
    m = schedule._n_microbatches
    if tensor.shape[0] % m:
        # Unequal microbatches would weigh each microbatch's mean equally and so no longer give
        # the batch mean.
        raise ConfigError(
            "parallel.pp_microbatches", f"must divide the per-rank batch size {tensor.shape[0]}, got {m} microbatches"
        )


def _stage_modules(schedule) -> list[PipelineStageModule]:
    """This rank's stage modules, from a single-stage or a multi-stage (interleaved) schedule."""
    stages = schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
    return [stage.submod for stage in stages]


def _mean_aux_loss(stages: list[PipelineStageModule], microbatches: int) -> torch.Tensor | None:
    """Sum over this rank's stages of the mean MoE auxiliary loss of the step's microbatches.

    The step's own forwards are each stage's last `microbatches` records: on the first step the
    schedule first runs one more forward, on stand-in tensors, to infer the shapes it sends.
    """
    total = None
    for stage in stages:
        records = stage.aux_losses[-microbatches:]
        stage.aux_losses = []
        if records:
            mean = torch.stack(records).sum() / microbatches
            total = mean if total is None else total + mean
    return total


def _run(schedule, inputs, targets, is_first: bool, is_last: bool, train: bool):
    args = ()
    if is_first:
        _check_batch(schedule, inputs)
        args = (inputs,)
    losses: list[torch.Tensor] | None = None
    kwargs = {}
    if is_last:
        _check_batch(schedule, targets)
        losses = []
        kwargs = {"target": targets, "losses": losses}
    stages = _stage_modules(schedule)
    for stage in stages:
        stage.aux_losses = []
    if train:
        # return_outputs=False: the last stage would otherwise keep and concatenate every
        # microbatch's logits, the largest activation in the model, only to return them.
        schedule.step(*args, return_outputs=False, **kwargs)
    else:
        schedule.eval(*args, **kwargs)
    # Validation reports the cross-entropy alone, as next_token_loss does without a pipeline.
    aux = _mean_aux_loss(stages, schedule._n_microbatches) if train else None
    loss = torch.stack([loss.detach() for loss in losses]).mean() if is_last else None
    if aux is None or loss is None:
        return loss if aux is None else aux
    return loss + aux


def pipeline_train_step(
    schedule, inputs: torch.Tensor | None, targets: torch.Tensor | None, is_first: bool, is_last: bool
) -> torch.Tensor | None:
    """One forward and backward of a whole batch through the pipeline; gradients accumulate into
    this rank's stage parameters. Returns this rank's share of the batch's mean training loss: the
    cross-entropy on the rank holding the last stage, plus the MoE auxiliary losses of the rank's
    own stages (mean over microbatches); None on a rank with neither. Summed over the pp ranks the
    shares are the loss one process logs for the same microbatches (cross-entropy + aux losses).
    The first stage's rank passes `inputs`, the last stage's rank `targets`."""
    return _run(schedule, inputs, targets, is_first, is_last, train=True)


@torch.no_grad()
def pipeline_eval_step(
    schedule, inputs: torch.Tensor | None, targets: torch.Tensor | None, is_first: bool, is_last: bool
) -> torch.Tensor | None:
    """Forward only (validation): the batch's mean loss on the last stage's rank, else None."""
    return _run(schedule, inputs, targets, is_first, is_last, train=False)


def bubble_fraction(schedule_name: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Share of a step that each rank spends idle in the pipeline bubble, for equal-cost stages.

    Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", sec. 2.2) give the bubble time relative to the ideal (bubble-free) time: (p-1)/m
    for GPipe and 1F1B (the same bubble; 1F1B only lowers activation memory), and (p-1)/(v m) with
    v model chunks per device for the interleaved schedule. As a share of the whole step (ideal +
    bubble) that is (p-1)/(m+p-1) and (p-1)/(v m+p-1).
    """
    if schedule_name not in PP_SCHEDULES:
        raise ConfigError("parallel.pp_schedule", f"must be one of {', '.join(PP_SCHEDULES)}, got {schedule_name!r}")
    v = stages_per_rank if schedule_name == "interleaved_1f1b" else 1
    if pp < 1 or microbatches < 1 or v < 1:
        raise ValueError(f"pp, microbatches and stages_per_rank must be >= 1, got {pp}, {microbatches}, {v}")
    return (pp - 1) / (v * microbatches + pp - 1)
