"""The device mesh of a run: which ranks share data, shard parameters, split layers or sequences.

One `DeviceMesh` is built with every dimension whose degree is > 1, in the order
pp, dp_replicate, dp_shard, cp, tp (outermost to innermost; with expert parallelism
dp_shard is split into (dp_shard_mod_ep, ep)): tensor parallelism talks the most, so
its ranks are adjacent (same node); pipeline stages talk the least. Flattened views name the groups
the training loop needs: "dp" (ranks that see different data), "dp_shard_cp" (the ranks FSDP shards
over: context-parallel ranks hold the same parameters, so they share the sharding), and "dp_cp"
(ranks whose losses are averaged).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kiln.errors import ConfigError
from kiln.parallel.config import ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        cfg.validate()
        fixed = cfg.dp_replicate * cfg.tp * cfg.pp * cfg.cp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ConfigError(
                    "parallel.dp_shard",
                    f"world size {world_size} is not divisible by dp_replicate*tp*pp*cp = {fixed}, so no dp_shard fits",
                )
            dp_shard = world_size // fixed
        if fixed * dp_shard != world_size:
            raise ConfigError(
                "parallel",
                f"dp_replicate({cfg.dp_replicate}) * dp_shard({dp_shard}) * tp({cfg.tp}) "
                f"* pp({cfg.pp}) * cp({cfg.cp}) = {fixed * dp_shard}, but the world size is {world_size}",
            )
        if cfg.ep > 1 and dp_shard % cfg.ep:
            raise ConfigError(
                "parallel.ep",
                f"experts are spread over ranks of the dp_shard dimension, so ep must "
                f"divide dp_shard={dp_shard}, got {cfg.ep}",
            )
        return cls(cfg.dp_replicate, dp_shard, cfg.tp, cfg.pp, cfg.cp, cfg.ep, world_size)

    @property
    def dp(self) -> int:
        """Ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def model_parallel(self) -> bool:
        """True when parameters are DTensors (sharded or split), so checkpoints must be sharded too."""
        return self.fsdp or self.tp > 1 or self.pp > 1 or self.ep > 1

    def check_model(self, model_cfg) -> None:
        """Degrees the model shape must allow, checked before any process builds anything."""
        if self.tp > 1:
            if model_cfg.kv_heads % self.tp:
                raise ConfigError(
                    "parallel.tp",
                    f"must divide model.n_kv_heads={model_cfg.kv_heads} (each rank "
                    f"holds whole key/value groups), got {self.tp}",
                )
            if model_cfg.ffn_hidden_size % self.tp:
                raise ConfigError(
                    "parallel.tp", f"must divide the FFN width {model_cfg.ffn_hidden_size}, got {self.tp}"
                )
            if any(model_cfg.is_moe_layer(i) for i in range(model_cfg.n_layers)):
                raise ConfigError(
                    "parallel.tp", "tensor parallelism does not split MoE experts; spread them with parallel.ep instead"
                )
            if model_cfg.tie_embeddings:
                raise ConfigError(
                    "parallel.tp",
                    "tensor parallelism needs model.tie_embeddings = false "
                    "(the embedding and the output head are sharded on different layouts)",
                )
            if model_cfg.qk_norm:
                # Each rank holds some heads, so the shared per-head norm weights would get per-rank
                # gradients that no collective reconciles (the TP plan does not replicate them).
                raise ConfigError(
                    "parallel.tp", "tensor parallelism does not shard model.qk_norm's per-head norms; set tp = 1"
                )
            if model_cfg.pos != "rope":
                raise ConfigError(
                    "parallel.tp",
                    f"sequence parallelism needs model.pos = 'rope' (an absolute "
                    f"position table would be added to a sequence shard), got {model_cfg.pos!r}",
                )
        if self.ep > 1 and not any(model_cfg.is_moe_layer(i) for i in range(model_cfg.n_layers)):
            raise ConfigError(
                "parallel.ep", "expert parallelism needs MoE layers (model.moe_every or model.moe_layers)"
            )
        if self.ep > 1 and model_cfg.n_experts % self.ep:
            raise ConfigError("parallel.ep", f"must divide model.n_experts={model_cfg.n_experts}, got {self.ep}")
        if self.pp > 1 and model_cfg.n_layers < self.pp:
            raise ConfigError("parallel.pp", f"cannot exceed model.n_layers={model_cfg.n_layers}, got {self.pp}")

    def _leaves(self) -> dict[str, int]:
        """Mesh dimensions in order, outermost first. With expert parallelism dp_shard is built as
        (dp_shard_mod_ep, ep) so the ep ranks are one named dimension; flattened back it is dp_shard."""
        shard = (
            {"dp_shard": self.dp_shard}
            if self.ep == 1
            else {"dp_shard_mod_ep": self.dp_shard // self.ep, "ep": self.ep}
        )
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, **shard, "cp": self.cp, "tp": self.tp}

    def _parts(self, name: str) -> tuple[str, ...]:
        shard = ("dp_shard",) if self.ep == 1 else ("dp_shard_mod_ep", "ep")
        return {
            "dp_shard": shard,
            "dp": ("dp_replicate", *shard),
            "dp_shard_cp": (*shard, "cp"),
            "dp_cp": ("dp_replicate", *shard, "cp"),
        }.get(name, (name,))

    def build_mesh(self, device_type: str):
        """The world's DeviceMesh with named, flattened sub-meshes; needs an initialised process group."""
        from torch.distributed.device_mesh import init_device_mesh

        leaves = self._leaves()
        names = [n for n, d in leaves.items() if d > 1] or ["dp_shard"]
        mesh = init_device_mesh(device_type, tuple(leaves.get(n, 1) for n in names), mesh_dim_names=tuple(names))
        # Flattened groups; a flatten over a single dim would only rename it, so those are aliases.
        for flat in ("dp_shard", "dp", "dp_shard_cp", "dp_cp"):
            present = tuple(n for n in self._parts(flat) if n in names)
            if len(present) > 1:
                mesh[present]._flatten(flat)
        return mesh

    def submesh(self, mesh, name: str):
        """A named (possibly flattened) sub-mesh, or None when that group is a single rank."""
        present = [n for n in self._parts(name) if n in mesh.mesh_dim_names]
        if not present:
            return None
        if len(present) == 1:
            return mesh[present[0]]
        return mesh[name]


def init_distributed(device_type: str) -> tuple[int, int]:
    """Join the job torchrun (or Slurm/Kubernetes via torchrun) started: (rank, world size).
    A process started without WORLD_SIZE > 1 stays single-process and creates no group."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # torchrun keeps one key-value store across elastic restarts. Without a per-attempt namespace, a
    # restarted rank can read the address a dead rank of the previous attempt published, and gloo's
    # connect then fails ("Connection refused") or hangs.
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"kiln/attempt-{attempt}", store), rank=rank, world_size=world
    )
    return dist.get_rank(), dist.get_world_size()


def check_job_options(cfg: ParallelConfig) -> None:
    """Refuse [parallel] options the layout this process will train in would not use (its torchrun
    world size, the device the Trainer picks), before the data stages in front of training run."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    dims = ParallelDims.from_config(cfg, world)
    try:
        cfg.check_options(dims.dp_shard, "cuda" if torch.cuda.is_available() else "cpu")
    except ConfigError as err:
        raise err.within("parallel") from None


def init_single_process_group(device_type: str) -> None:
    """A one-rank process group in this process, for FSDP2 on one device (parallel.offload).

    gloo serves the CPU side (DCP's async_save needs a CPU backend), NCCL the GPU tensors FSDP2
    gathers. It lives as long as the process, as a torchrun worker's group does.
    """
    import atexit

    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
