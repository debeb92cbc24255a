"""How a training run is laid out over devices: the `[parallel]` table of a recipe."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
GRAD_SYNCS = ("per_microbatch", "deferred")
OUTERS = ("none", "diloco")
OUTER_KEYS = ("outer_steps", "outer_lr", "outer_momentum", "outer_nesterov", "outer_fragments", "outer_join_timeout_s")


@dataclass
class ParallelConfig:
    # Mesh degrees. Their product is the world size; dp_shard = -1 takes whatever is left.
    dp_replicate: int = 1  # data-parallel replicas (DDP, or the replicate axis of HSDP)
    dp_shard: int = -1  # FSDP2 shards (ZeRO-3 by default; see reshard_after_forward)
    tp: int = 1  # tensor (+ sequence) parallel, within a node
    pp: int = 1  # pipeline stages
    cp: int = 1  # context parallel: the sequence split across ranks
    ep: int = 1  # expert parallel: MoE experts spread across ranks (borrows dp_shard x cp ranks)
    # FSDP2
    reshard_after_forward: bool = True  # True: ZeRO-3 (params freed after forward); False: ZeRO-2-like
    offload: bool = False  # parameters, gradients and optimizer state kept on the CPU (GPU runs only)
    reduce_dtype: str = "fp32"  # dtype of FSDP2's gradient reduce-scatter: fp32 | bf16
    # When FSDP2 reduce-scatters gradients under accumulation: every micro-batch (each rank keeps only
    # its gradient shard, ZeRO-2/3) or on the last micro-batch only (full gradients accumulate, one
    # reduce-scatter per step, ZeRO-1-like). DDP and pipelining have their own rule (docs/parallel.md).
    grad_sync: str = "per_microbatch"  # per_microbatch | deferred
    # Pipeline
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b
    pp_microbatches: int = 0  # 0: 2 x pp (halves the bubble vs pp microbatches)
    pp_stages_per_rank: int = 1  # > 1 only with interleaved_1f1b (virtual stages)
    # Context parallel
    cp_backend: str = "auto"  # auto (torch on NCCL, else ring) | ring | allgather | torch
    cp_load_balance: bool = True  # rank r gets sequence chunks r and 2cp-1-r: equal causal work
    # DiLoCo (docs/parallel.md, "DiLoCo"): replicas step locally and average their weight change
    # every outer_steps steps with an outer SGD step. Values are the paper's (Douillard et al. 2023).
    outer: str = "none"  # none (gradients all-reduced every step) | diloco
    outer_steps: int = 500  # H: inner steps per outer round
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    outer_fragments: int = 1  # > 1: streaming DiLoCo, fragment f syncs at steps f*H/F (mod H)
    outer_join_timeout_s: float = 0.0  # > 0: replicas missing this long at an outer round are dropped
    # Checkpoints
    async_checkpoint: bool = False  # checkpoints are written in the background while training goes on

    def validate(self) -> None:
        for key in ("dp_replicate", "tp", "pp", "cp", "ep", "pp_stages_per_rank"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError("dp_shard", f"must be >= 1, or -1 for the rest of the world size, got {self.dp_shard}")
        if self.pp_microbatches < 0:
            raise ConfigError("pp_microbatches", f"must be >= 0, got {self.pp_microbatches}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError("pp_schedule", f"must be one of {', '.join(PP_SCHEDULES)}, got {self.pp_schedule!r}")
        if self.pp_stages_per_rank > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ConfigError(
                "pp_stages_per_rank",
                f"more than one stage per rank needs pp_schedule = 'interleaved_1f1b', got {self.pp_schedule!r}",
            )
        if self.cp_backend not in ("auto", "ring", "allgather", "torch"):
            raise ConfigError("cp_backend", f"must be one of auto, ring, allgather, torch, got {self.cp_backend!r}")
        if self.reduce_dtype not in ("fp32", "bf16"):
            raise ConfigError("reduce_dtype", f"must be fp32 or bf16, got {self.reduce_dtype!r}")
        if self.grad_sync not in GRAD_SYNCS:
            raise ConfigError("grad_sync", f"must be one of {', '.join(GRAD_SYNCS)}, got {self.grad_sync!r}")
        self._check_outer()
        if self.dp_shard != -1:  # every degree is given, so the world size is known already
            self.check_options(self.dp_shard, device_type=None)

    def check_options(self, dp_shard: int, device_type: str | None) -> None:
        """Refuse a memory or reduction option the layout would not use (docs/parallel.md, "Which
        options apply where"). `dp_shard` is resolved (never -1); `device_type` None skips the
        checks that depend on the device."""
        world = self.dp_replicate * dp_shard * self.tp * self.pp * self.cp
        sharded = dp_shard * self.cp > 1
        layout = self.describe(dp_shard)
        if self.dp_replicate > 1 and not sharded and (self.tp > 1 or self.pp > 1):
            raise ConfigError(
                "dp_replicate",
                f"replicas of a tensor- or pipeline-parallel layout ({layout}) are averaged only by HSDP; "
                "set dp_shard > 1 (FSDP over the data-parallel ranks) instead",
            )
        if self.offload and device_type == "cpu":
            raise ConfigError(
                "offload",
                "moves parameters, gradients and optimizer state from the GPU to CPU memory; "
                "on device cpu they are there already",
            )
        if self.offload and world > 1 and not sharded:
            raise ConfigError(
                "offload", f"is FSDP2's CPU offload and {layout} shards nothing: it needs dp_shard * cp > 1"
            )
        if not self.reshard_after_forward and not (sharded or (world == 1 and self.offload)):
            raise ConfigError(
                "reshard_after_forward",
                f"applies to FSDP2 (dp_shard * cp > 1, or offload = true in one process); {layout} gathers no parameters",
            )
        if self.reduce_dtype != "fp32" and not sharded:
            raise ConfigError(
                "reduce_dtype",
                f"is the dtype of FSDP2's gradient reduce-scatter, which needs dp_shard * cp > 1; {layout} has none",
            )
        if self.grad_sync != "per_microbatch":
            self._check_deferred_sync(sharded, layout)
        if self.outer == "diloco" and (dp_shard > 1 or self.dp_replicate == 1):
            raise ConfigError(
                "outer",
                f"diloco needs data-parallel replicas and nothing sharded across them (dp_replicate > 1, "
                f"dp_shard = 1); {layout} has {'FSDP shards' if dp_shard > 1 else 'one replica'}",
            )

    def _check_outer(self) -> None:
        if self.outer not in OUTERS:
            raise ConfigError("outer", f"must be one of {', '.join(OUTERS)}, got {self.outer!r}")
        if self.outer == "none":
            defaults = ParallelConfig()
            for key in OUTER_KEYS:
                if getattr(self, key) != getattr(defaults, key):
                    raise ConfigError(key, "is set but outer is 'none' (set outer = 'diloco' to use it)")
            return
        for key in ("outer_steps", "outer_fragments"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.outer_steps % self.outer_fragments:
            raise ConfigError(
                "outer_fragments",
                f"must divide outer_steps={self.outer_steps} (fragments sync every outer_steps / fragments steps)",
            )
        if self.outer_lr <= 0:
            raise ConfigError("outer_lr", f"must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError("outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        if self.outer_nesterov and self.outer_momentum == 0:
            raise ConfigError("outer_nesterov", "needs outer_momentum > 0")
        if self.outer_join_timeout_s < 0:
            raise ConfigError("outer_join_timeout_s", f"must be >= 0, got {self.outer_join_timeout_s}")
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(self, key) > 1:
                raise ConfigError(
                    "outer", f"diloco averages whole replicas; {key}={getattr(self, key)} is not supported"
                )
        if self.dp_shard not in (1, -1):
            raise ConfigError(
                "outer", f"diloco replicas are plain data-parallel ranks; dp_shard={self.dp_shard} would shard them"
            )
        if self.offload:
            raise ConfigError("outer", "diloco does not shard, and offload is FSDP2's")

    def _check_deferred_sync(self, sharded: bool, layout: str) -> None:
        if not sharded:
            raise ConfigError(
                "grad_sync",
                f"chooses when FSDP2 reduce-scatters gradients, which needs dp_shard * cp > 1; {layout} has no "
                "reduce-scatter (DDP always all-reduces once, on the last micro-batch)",
            )
        if self.pp > 1:
            raise ConfigError(
                "grad_sync",
                "is decided by the pipeline schedule under pp > 1: it accumulates full gradients over its "
                "micro-batches and reduce-scatters them after the last",
            )

    def describe(self, dp_shard: int) -> str:
        """The layout in words for error messages: 'one process' or its degrees above 1."""
        degrees = {"dp_replicate": self.dp_replicate, "dp_shard": dp_shard, "tp": self.tp, "pp": self.pp, "cp": self.cp}
        above = [f"{name}={d}" for name, d in degrees.items() if d > 1]
        return "one process" if not above else "the layout " + " ".join(above)

    @property
    def microbatches(self) -> int:
        return self.pp_microbatches or 2 * self.pp * self.pp_stages_per_rank
