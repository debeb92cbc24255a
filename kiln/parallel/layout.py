"""What the training loop needs to know about the device layout, in one object.

The Trainer asks a `Layout` which data rank it is, how to wrap the model, under which context the
loss runs, which ranks' losses to average, how to clip, and how to save; a single process gets the
trivial answers, so the loop has one code path for one CPU and for a 3-D mesh.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from kiln.parallel.config import ParallelConfig
from kiln.parallel.dims import ParallelDims


class Layout:
    def __init__(self, cfg: ParallelConfig | None, model_cfg, device: torch.device):
        self.cfg = cfg or ParallelConfig()
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.dims = ParallelDims.from_config(self.cfg, self.world_size)
        self.dims.check_model(model_cfg)
        self.mesh = self.dims.build_mesh(device.type) if distributed else None
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

    def _sub(self, name: str):
        return self.dims.submesh(self.mesh, name) if self.mesh is not None else None

    @property
    def sharded(self) -> bool:
        """Parameters are DTensors: checkpoints are written by every rank with DCP."""
        return self.dims.model_parallel

    @property
    def grad_average_ranks(self) -> int:
        """Ranks the data-parallel gradient reduction averages over (dp x cp)."""
        return self.dims.dp * self.dims.cp

    def parallelize(self, model, compute_dtype: torch.dtype, activation_checkpointing: bool,
                    compile_blocks: bool):
        from kiln.parallel.parallelize import parallelize
        if self.mesh is None:
            self.forward_model = model
            return model
        self.forward_model = parallelize(model, self.dims, self.mesh, self.cfg, compute_dtype=compute_dtype,
                                         activation_checkpointing=activation_checkpointing,
                                         compile_blocks=compile_blocks)
        return self.forward_model

    def gradient_sync(self, last_micro_batch: bool):
        """Reduce gradients across data-parallel ranks only in the last micro-batch's backward."""
        model = self.forward_model
        if last_micro_batch or model is None:
            return nullcontext()
        if hasattr(model, "no_sync"):  # DDP
            return model.no_sync()
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
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
        from kiln.parallel.context import shard_sequence
        inputs, targets = batch[:2]
        return shard_sequence(inputs, targets, self.cp_rank, self.dims.cp, load_balance=True)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.loss_group is not None:
            dist.all_reduce(tensor, group=self.loss_group)
        return tensor

    def clip_grad_norm(self, params, max_norm: float) -> torch.Tensor:
        if not self.sharded:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        from kiln.parallel.grad import clip_grad_norm
        return clip_grad_norm(params, max_norm, self.pp_mesh.get_group() if self.pp_mesh is not None else None)

    def load_full_optimizer_state(self, model, optimizer, state: dict) -> None:
        """Load a single-file checkpoint's optimizer state (keyed by position, unsharded tensors)
        into an optimizer over this layout's (possibly sharded) parameters."""
        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        name_of = {id(p): n for n, p in model.named_parameters()}
        ordered = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
        saved_ids = [i for group in state["param_groups"] for i in group["params"]]
        if len(saved_ids) != len(ordered):
            raise ValueError(f"optimizer state has {len(saved_ids)} parameters, the model {len(ordered)}")
        name_by_id = dict(zip(saved_ids, ordered))
        by_name = {"state": {name_by_id[i]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [name_by_id[i] for i in g["params"]]}
                                    for g in state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


class _ReenableSync:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)
        return False
