"""What the training loop needs to know about the device layout, in one object.

The Trainer asks a `Layout` which data rank it is, how to wrap the model, under which context the
loss runs, which ranks' losses to average, how to clip, and how to save; a single process gets the
trivial answers, so the loop has one code path for one CPU and for a 3-D mesh.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from kiln.errors import ConfigError
from kiln.parallel.config import ParallelConfig
from kiln.parallel.context import shard_sequence
from kiln.parallel.diloco import DiLoCo
from kiln.parallel.dims import ParallelDims, init_single_process_group
from kiln.parallel.grad import clip_grad_norm
from kiln.parallel.parallelize import parallelize
from kiln.parallel.pipeline import (
    PipelineParts,
    bubble_fraction,
    build_pipeline_schedule,
    pipeline_eval_step,
    pipeline_train_step,
    split_model,
)


class Layout:
    def __init__(self, cfg: ParallelConfig | None, model_cfg, device: torch.device):
        self.cfg = cfg or ParallelConfig()
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.dims = ParallelDims.from_config(self.cfg, self.world_size)
        self.dims.check_model(model_cfg)
        try:
            self.cfg.check_options(self.dims.dp_shard, device.type)
        except ConfigError as err:
            raise err.within("parallel") from None
        # One process with offload: FSDP2 keeps the parameters on the CPU and copies each block to
        # the GPU for its forward and backward, which needs a mesh, so a one-rank group.
        self.one_rank_fsdp = self.world_size == 1 and self.cfg.offload
        if self.one_rank_fsdp and not distributed:
            init_single_process_group(device.type)
        needs_mesh = self.world_size > 1 or self.one_rank_fsdp
        self.mesh = self.dims.build_mesh(device.type) if needs_mesh else None
        self.dp_mesh = self._sub("dp")
        self.dp_rank = self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0
        self.dp_size = self.dims.dp
        self.cp_mesh = self._sub("cp")
        self.cp_rank = self.cp_mesh.get_local_rank() if self.cp_mesh is not None else 0
        self.pp_mesh = self._sub("pp")
        loss_mesh = self._sub("dp_cp")
        # Ranks whose token losses are summed into the step's loss: the data-parallel ranks and the
        # context-parallel ranks (each holds a slice of every sequence). TP ranks hold the same loss.
        self.loss_group = loss_mesh.get_group() if loss_mesh is not None else None
        self.forward_model = None
        self.diloco: DiLoCo | None = None  # built by parallelize() under outer = "diloco"
        self.stages, self.schedule, self.is_first, self.is_last = [], None, True, True

    def _sub(self, name: str):
        return self.dims.submesh(self.mesh, name) if self.mesh is not None else None

    @property
    def sharded(self) -> bool:
        """Parameters are DTensors: checkpoints are written by every rank with DCP."""
        return self.dims.model_parallel or self.one_rank_fsdp

    @property
    def grad_average_ranks(self) -> int:
        """Ranks the data-parallel gradient reduction averages over (dp x cp); 1 under DiLoCo,
        whose replicas keep their own gradients."""
        return 1 if self.cfg.outer == "diloco" else self.dims.dp * self.dims.cp

    def after_optimizer_step(self, step: int, final: bool) -> None:
        """DiLoCo's outer round: the fragments due after inner step `step` (all of them on the
        run's last step, so the final weights are the replicas' common model)."""
        if self.diloco is not None:
            self.diloco.after_step(step, final)

    def parallelize(self, model, compute_dtype: torch.dtype, activation_checkpointing: str, compile_blocks: bool):
        """(module whose parameters and state dict are this rank's, module to call for training).
        Without pipelining both are the model (or the model and its DDP wrapper); with it, the first
        is the rank's stages under the unsplit names and training runs through `self.schedule`."""
        if self.mesh is None:
            self.forward_model = model
            return model, model
        kwargs = dict(
            compute_dtype=compute_dtype,
            activation_checkpointing=activation_checkpointing,
            compile_blocks=compile_blocks,
        )
        if self.dims.pp == 1:
            self.forward_model = parallelize(model, self.dims, self.mesh, self.cfg, **kwargs)
            if self.cfg.outer == "diloco":
                self.diloco = self._diloco(model)
            return model, self.forward_model
        self.stages = split_model(model, self.pp_mesh.get_local_rank(), self.dims.pp, self.cfg.pp_stages_per_rank)
        for stage in self.stages:
            parallelize(stage, self.dims, self.mesh, self.cfg, **kwargs)
        # scale_grads=False: the trainer accumulates several schedule steps per optimizer step and
        # divides the summed micro-batch gradients once (Trainer.train_step).
        self.schedule = build_pipeline_schedule(
            self.stages, self.pp_mesh, self.cfg, scale_grads=False, device=next(model.parameters()).device
        )
        self.is_first = any(stage.is_first for stage in self.stages)
        self.is_last = any(stage.is_last for stage in self.stages)
        return PipelineParts(self.stages), None

    def _diloco(self, model) -> DiLoCo:
        cfg = self.cfg
        try:
            return DiLoCo(
                [p for p in model.parameters() if p.requires_grad],
                outer_steps=cfg.outer_steps,
                lr=cfg.outer_lr,
                momentum=cfg.outer_momentum,
                nesterov=cfg.outer_nesterov,
                fragments=cfg.outer_fragments,
                group=self.dp_mesh.get_group(),
                join_timeout_s=cfg.outer_join_timeout_s,
            )
        except ConfigError as err:
            raise err.within("parallel") from None

    @property
    def pipelined(self) -> bool:
        return self.dims.pp > 1

    def pipeline_step(self, batch: tuple, train: bool) -> torch.Tensor:
        """One batch through the pipeline: this rank's share of its mean loss (the cross-entropy on
        the last stage's rank, plus in training the MoE aux losses of the rank's stages), 0 where
        there is none; `reduce_loss_stats` sums the shares over the pp group."""
        inputs, targets = batch[:2]
        run = pipeline_train_step if train else pipeline_eval_step
        loss = run(
            self.schedule,
            inputs if self.is_first else None,
            targets if self.is_last else None,
            self.is_first,
            self.is_last,
        )
        return loss if loss is not None else torch.zeros((), device=inputs.device)

    def bubble_fraction(self) -> float:
        if not self.pipelined:
            return 0.0
        return bubble_fraction(self.cfg.pp_schedule, self.dims.pp, self.cfg.microbatches, self.cfg.pp_stages_per_rank)

    def gradient_sync(self, last_micro_batch: bool):
        """The context of one micro-batch's backward: whether it reduces gradients across the
        data-parallel ranks. DDP reduces in the last micro-batch only; FSDP2 in every micro-batch
        (grad_sync = "per_microbatch": each rank keeps just its gradient shard) or in the last only
        ("deferred": full gradients accumulate, one reduce-scatter per step). Under pipelining the
        schedule decides."""
        model = self.forward_model
        if last_micro_batch or model is None or self.pipelined:
            return nullcontext()
        if hasattr(model, "no_sync"):  # DDP
            return model.no_sync()
        if hasattr(model, "set_requires_gradient_sync") and self.cfg.grad_sync == "deferred":  # FSDP2
            model.set_requires_gradient_sync(False)
            return _ReenableSync(model)
        return nullcontext()

    def loss_context(self):
        """Under TP the logits stay sharded over the vocabulary; loss_parallel computes the
        cross-entropy on the shards without gathering them."""
        if self.dims.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()

    def shard_batch(self, batch: tuple) -> tuple:
        """Context parallelism: this rank's slice of every sequence, with its global positions."""
        if self.dims.cp == 1:
            return batch
        inputs, targets = batch[:2]
        return shard_sequence(inputs, targets, self.cp_rank, self.dims.cp, load_balance=self.cfg.cp_load_balance)

    def reduce_step_stats(self, loss_sum: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        """A training step's loss statistics: the whole step's (reduce_loss_stats), except under
        DiLoCo, whose inner steps communicate nothing: there they are this replica's own."""
        if self.diloco is not None:
            return loss_sum, tokens
        return self.reduce_loss_stats(loss_sum, tokens)

    def reduce_loss_stats(self, loss_sum: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        """(sum of token losses, token count) of the whole step from this rank's share. Under
        pipelining only the last stage has the loss, so it is first summed over the pp group.
        Under DiLoCo the sum runs over the replicas still members (a dropped one is left out)."""
        if self.world_size == 1:
            return loss_sum, tokens
        if self.pp_mesh is not None:
            loss_sum = loss_sum.clone()
            dist.all_reduce(loss_sum, group=self.pp_mesh.get_group())
        stats = torch.stack(
            [loss_sum.to(torch.float64), torch.tensor(float(tokens), dtype=torch.float64, device=loss_sum.device)]
        )
        group = self.diloco.group if self.diloco is not None else self.loss_group
        if group is not None:
            dist.all_reduce(stats, group=group)
        return stats[0].to(loss_sum.dtype), int(stats[1].item())

    def clip_grad_norm(self, params, max_norm: float) -> torch.Tensor:
        if not self.sharded:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return clip_grad_norm(params, max_norm, self.pp_mesh.get_group() if self.pp_mesh is not None else None)

    def load_full_optimizer_state(self, model, optimizer, state: dict) -> None:
        """Load a single-file checkpoint's optimizer state (keyed by position, unsharded tensors)
        into an optimizer over this layout's (possibly sharded) parameters."""
        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        parts = getattr(optimizer, "parts", None)  # several optimizers joined (kiln.train.muon.MuonAdamW)
        if parts is not None:
            if set(state) != set(parts):
                raise ConfigError(
                    "optimizer",
                    f"the checkpoint's optimizer state was not written by this optimizer ({' + '.join(parts)})",
                )
            for name, part in parts.items():
                self.load_full_optimizer_state(model, part, state[name])
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        name_of = {id(p): n for n, p in model.named_parameters()}
        ordered = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
        saved_ids = [i for group in state["param_groups"] for i in group["params"]]
        if len(saved_ids) != len(ordered):
            raise ValueError(f"optimizer state has {len(saved_ids)} parameters, the model {len(ordered)}")
        name_by_id = dict(zip(saved_ids, ordered))
        by_name = {
            "state": {name_by_id[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [name_by_id[i] for i in g["params"]]} for g in state["param_groups"]],
        }
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


class _ReenableSync:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)
        return False
