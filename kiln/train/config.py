"""Config of the training loop shared by every training stage."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

from kiln.errors import ConfigError
from kiln.model.config import AC_MODES

FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's float8 training recipes Kiln offers

LOGGERS = ("tensorboard", "wandb", "mlflow")
OPTIMIZERS = ("adamw", "lion", "adafactor", "muon")


ACTIONS = ("off", "skip", "rollback")


def refuse_bool_checkpointing(value) -> str | None:
    """The message for a true/false `activation_checkpointing` (the key was a boolean before it
    took a mode), or None: one spelling for each setting."""
    if isinstance(value, bool):
        return f'is a mode now: write "{"full" if value else "none"}" for {str(value).lower()} (modes: {", ".join(AC_MODES)})'
    return None


@dataclass
class GuardConfig:
    action: str = "skip"  # off | skip | rollback
    spike_sigma: float = 6.0  # a spike is a loss above mean + spike_sigma * std; 0: only NaN/inf
    spike_min_rise: float = 0.1  # ... and above mean + this (nats), so a flat curve's noise is no spike
    window: int = 100  # accepted steps in the rolling mean and std
    min_history: int = 50  # accepted steps before spikes are looked for
    lr_factor: float = 1.0  # rollback: multiply the learning rate by this after each rollback
    max_events: int = 100  # flagged steps allowed in the run; one more stops it; 0: no limit

    def validate(self) -> None:
        if self.action not in ACTIONS:
            raise ConfigError("action", f"must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        for key in ("spike_sigma", "spike_min_rise", "max_events"):
            if not 0 <= getattr(self, key) < math.inf:  # also refuses NaN
                raise ConfigError(key, f"must be a finite number >= 0, got {getattr(self, key)}")
        if self.window < 2:
            raise ConfigError(
                "window", f"must be at least 2 (a standard deviation needs two losses), got {self.window}"
            )
        if not 2 <= self.min_history <= self.window:
            raise ConfigError("min_history", f"must be in [2, window={self.window}], got {self.min_history}")
        if not 0 < self.lr_factor <= 1:
            raise ConfigError("lr_factor", f"must be in (0, 1], got {self.lr_factor}")


# A warmup left unset (train.warmup_steps = -1) is this share of max_steps, at most WARMUP_CAP steps:
# 5% keeps the 600-step demo's 30 steps and leaves a short run (max_steps=30) most of its decay; the
# cap is Llama 2's warmup (Touvron et al. 2023: 2000 steps at every size).
WARMUP_FRACTION = 0.05
WARMUP_CAP = 2000


@dataclass
class ReplayConfig:
    """[train.replay]: a share of every batch drawn from an earlier run's pack (continual
    pretraining), and that pack's validation split evaluated beside the new one (docs/continual.md)."""

    pack: str = ""  # the earlier pack folder; "": no replay
    fraction: float = 0.0  # share of training sequences drawn from it; 0: evaluate its split only

    def validate(self) -> None:
        if not 0 <= self.fraction < 1:
            raise ConfigError(
                "fraction", f"must be in [0, 1) (1 would train on the old pack alone), got {self.fraction}"
            )
        if self.fraction > 0 and not self.pack:
            raise ConfigError("fraction", f"is {self.fraction} but pack is not set: name the earlier run's pack folder")


@dataclass
class TrainConfig:
    seq_len: int = 256
    micro_batch_size: int = 8
    global_batch_tokens: int = 16384  # tokens per optimizer step, across ranks and accumulation
    max_steps: int = 300
    optimizer: str = "adamw"  # adamw | lion | adafactor | muon (Muon on block matrices, AdamW on the rest)
    muon_lr: float = 0.0  # muon: peak lr of the matrices; 0: 0.02 ("original"), lr ("match_rms_adamw")
    muon_momentum: float = 0.95  # muon: momentum (Nesterov)
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per step
    muon_adjust_lr: str = "original"  # muon: original (sqrt(max(1, out/in))) | match_rms_adamw (0.2 sqrt(max dim))
    # muon: dtype of the Newton-Schulz matmuls. auto: bfloat16 (torch.optim.Muon's) on a GPU and on a
    # CPU with fast bf16 matmuls, float32 where bf16 has no kernels (AVX2 only: 53x faster there)
    muon_ns_dtype: str = "auto"  # auto | bfloat16 | float32
    # adamw: foreach (bit-equal to torch's single-tensor reference) | fused (one kernel per tensor
    # group, faster on CPU and CUDA, rounds differently; docs/pretrain.md "AdamW implementation")
    optimizer_impl: str = "foreach"
    # nvme: AdamW's moments live in files and stream through memory a chunk at a time (docs/offload.md)
    optimizer_offload: str = "none"  # none | nvme
    optimizer_offload_dir: str = ""  # nvme: folder for the swap files; "": <stage folder>/optimizer_offload
    optimizer_offload_chunk_mb: int = 0  # nvme: optimizer state per streamed chunk, MiB; 0: 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    # -1: derived from max_steps (warmup(): WARMUP_FRACTION, at most WARMUP_CAP), noted at the start
    warmup_steps: int = -1
    schedule: str = "cosine"  # cosine | wsd | constant
    decay_fraction: float = 0.2  # wsd: share of steps spent decaying at the end
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only
    grad_clip: float = 1.0  # 0: off
    # auto: CUDA when torch sees a GPU (each rank its own under torchrun), else the CPU; cpu; cuda; cuda:N
    device: str = "auto"
    # auto (bf16 where this device's bf16 matmuls are faster, else fp32) | fp32 | bf16 | fp16 |
    # fp8 (torchao float8 block linears, bf16 elsewhere)
    precision: str = "auto"
    fp8_recipe: str = ""  # precision = "fp8" only: tensorwise | rowwise; "": tensorwise
    # none | selective | full (kiln.parallel.parallelize.apply_activation_checkpointing)
    activation_checkpointing: str = field(default="none", metadata={"refuse": refuse_bool_checkpointing})
    compile: bool = False
    # The output head and cross-entropy over this many tokens at a time, so [tokens, vocab] logits
    # are never held whole (kiln.train.chunked_ce; docs/pretrain.md "Chunked loss head"); 0: off
    loss_chunk_tokens: int = 0
    seed: int = 1337
    log_every: int = 10
    eval_every: int = 50
    # 0: the whole validation split at every evaluation; n: a fixed sample of n global batches
    # (n * micro_batch_size * data-parallel ranks windows) spread over the whole split.
    eval_batches: int = 0
    ckpt_every: int = 100
    keep_last: int = 2
    keep_best: bool = True
    # "": <stage folder>/checkpoints; a local folder or an fsspec URL (s3://bucket/run/checkpoints),
    # published manifest last on object stores (docs/storage.md)
    checkpoint_dir: str = ""
    early_stop_patience: int = 0  # evaluations without improvement before stopping; 0: off
    peak_flops: float = 0.0  # per device, for MFU; 0: detect (measured matmul on CPU)
    threads: int = 0  # torch intra-op threads; 0: leave torch's default
    loggers: list[str] = field(default_factory=list)  # besides metrics.jsonl: tensorboard, wandb, mlflow
    watchdog_s: float = 0.0  # exit (code 3) if a step or checkpoint save takes longer; 0: off
    batch_ramp_steps: int = 0  # grow the global batch linearly over this many first steps; 0: off
    batch_ramp_start_tokens: int = 0  # global batch of the first step while ramping
    # Sequence-length warmup (pretraining): the first steps train on shorter windows, the same tokens
    # per step cut into more rows; the length climbs from seq_len_start to seq_len over this many steps.
    seq_len_warmup_steps: int = 0  # 0: off
    seq_len_start: int = 0  # window length of the first step; a divisor of seq_len
    guard: GuardConfig = field(default_factory=GuardConfig)  # [train.guard]: loss-spike and NaN guard
    replay: ReplayConfig = field(default_factory=ReplayConfig)  # [train.replay]: continual pretraining

    def warmup(self) -> int:
        """The warmup the schedule uses: warmup_steps, or when it is -1 WARMUP_FRACTION of max_steps
        (so a short run keeps a decay phase), at most WARMUP_CAP steps."""
        return self.warmup_steps if self.warmup_steps >= 0 else min(WARMUP_CAP, int(self.max_steps * WARMUP_FRACTION))

    def warmup_note(self) -> str | None:
        """The line printed when the warmup was derived rather than set."""
        if self.warmup_steps >= 0:
            return None
        steps = f"{self.warmup()} step{'s' if self.warmup() != 1 else ''}"
        return (
            f"note: train.warmup_steps not set: warming up for {steps} "
            f"({WARMUP_FRACTION:.0%} of max_steps={self.max_steps}, at most {WARMUP_CAP})"
        )

    def validate(self) -> None:
        for key in (
            "seq_len",
            "micro_batch_size",
            "global_batch_tokens",
            "max_steps",
            "log_every",
            "eval_every",
            "ckpt_every",
            "keep_last",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        if self.global_batch_tokens % (self.seq_len * self.micro_batch_size):
            raise ConfigError(
                "global_batch_tokens",
                f"must be a multiple of seq_len*micro_batch_size="
                f"{self.seq_len * self.micro_batch_size}, got {self.global_batch_tokens}",
            )
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise ConfigError("device", f'must be "auto", "cpu", "cuda" or "cuda:N", got {self.device!r}')
        refused = refuse_bool_checkpointing(self.activation_checkpointing)
        if refused:
            raise ConfigError("activation_checkpointing", refused)
        choices = {
            "activation_checkpointing": AC_MODES,
            "optimizer": OPTIMIZERS,
            "optimizer_impl": ("foreach", "fused"),
            "muon_adjust_lr": ("original", "match_rms_adamw"),
            "muon_ns_dtype": ("auto", "bfloat16", "float32"),
            "optimizer_offload": ("none", "nvme"),
            "schedule": ("cosine", "wsd", "constant"),
            "precision": ("auto", "fp32", "bf16", "fp16", "fp8"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(key, f"must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        if self.fp8_recipe and self.precision != "fp8":
            raise ConfigError("fp8_recipe", f'applies only with precision = "fp8", got precision = {self.precision!r}')
        if self.fp8_recipe not in ("", *FP8_RECIPES):
            raise ConfigError("fp8_recipe", f"must be one of {', '.join(FP8_RECIPES)}, got {self.fp8_recipe!r}")
        # Written as `not low < x < high` so that NaN (every comparison false) is refused as well: a
        # TrainConfig built in Python skips the recipe's refusal of non-finite numbers.
        for key in ("lr", "eps"):
            if not 0 < getattr(self, key) < math.inf:
                raise ConfigError(key, f"must be a positive finite number, got {getattr(self, key)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps != -1 and not 0 <= self.warmup_steps < self.max_steps:
            raise ConfigError(
                "warmup_steps", f"must be -1 (derived) or in [0, max_steps={self.max_steps}), got {self.warmup_steps}"
            )
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError("decay_fraction", f"must be in (0, 1], got {self.decay_fraction}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(key, f"must be in [0, 1), got {getattr(self, key)}")
        for key in (
            "eval_batches",
            "weight_decay",
            "grad_clip",
            "peak_flops",
            "early_stop_patience",
            "threads",
            "watchdog_s",
            "batch_ramp_steps",
            "batch_ramp_start_tokens",
            "loss_chunk_tokens",
            "seq_len_warmup_steps",
            "seq_len_start",
        ):
            if not 0 <= getattr(self, key) < math.inf:  # also refuses NaN
                raise ConfigError(key, f"must be a finite number >= 0, got {getattr(self, key)}")
        self._validate_offload()
        self._validate_muon()
        for name in self.loggers:
            if name not in LOGGERS:
                raise ConfigError(
                    "loggers", f"unknown logger {name!r}; known: {', '.join(LOGGERS)} (metrics.jsonl is always written)"
                )
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError("loggers", f"names a logger twice: {self.loggers}")
        if self.batch_ramp_steps > 0:
            micro = self.seq_len * self.micro_batch_size
            if not 0 < self.batch_ramp_start_tokens <= self.global_batch_tokens:
                raise ConfigError(
                    "batch_ramp_start_tokens",
                    f"must be in (0, global_batch_tokens={self.global_batch_tokens}] when "
                    f"batch_ramp_steps > 0, got {self.batch_ramp_start_tokens}",
                )
            if self.batch_ramp_start_tokens % micro:
                raise ConfigError(
                    "batch_ramp_start_tokens",
                    f"must be a multiple of seq_len*micro_batch_size={micro} (the batch grows "
                    f"in whole micro-batches), got {self.batch_ramp_start_tokens}",
                )
        self._validate_seq_len_warmup()
        for name in ("guard", "replay"):
            try:
                getattr(self, name).validate()
            except ConfigError as err:
                raise err.within(name) from None

    def _validate_seq_len_warmup(self) -> None:
        if self.seq_len_warmup_steps == 0:
            if self.seq_len_start:
                raise ConfigError("seq_len_start", "is set but seq_len_warmup_steps is 0 (set both, or neither)")
            return
        if not 0 < self.seq_len_start < self.seq_len or self.seq_len % self.seq_len_start:
            raise ConfigError(
                "seq_len_start",
                f"must be a divisor of seq_len={self.seq_len} below it when seq_len_warmup_steps > 0 "
                f"(the windows are the rows cut into equal parts), got {self.seq_len_start}",
            )
        if self.seq_len_warmup_steps >= self.max_steps:
            raise ConfigError(
                "seq_len_warmup_steps",
                f"must be below max_steps={self.max_steps}, got {self.seq_len_warmup_steps}",
            )

    def _validate_muon(self) -> None:
        if self.optimizer != "muon":
            for key in MUON_DEFAULTS:
                if getattr(self, key) != MUON_DEFAULTS[key]:
                    raise ConfigError(
                        key,
                        f"is set but optimizer is {self.optimizer!r} (set optimizer = 'muon', "
                        f"or {key} = {MUON_DEFAULTS[key]!r}, its default)",
                    )
            return
        if not 0 <= self.muon_lr < math.inf:
            raise ConfigError("muon_lr", f"must be a finite number >= 0 (0: the default), got {self.muon_lr}")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError("muon_momentum", f"must be in [0, 1), got {self.muon_momentum}")
        if not 1 <= self.muon_ns_steps < 100:  # torch's Muon refuses 100 or more
            raise ConfigError("muon_ns_steps", f"must be in [1, 99], got {self.muon_ns_steps}")

    def _validate_offload(self) -> None:
        if self.optimizer_impl == "fused" and self.optimizer not in ("adamw", "muon"):
            raise ConfigError(
                "optimizer_impl",
                f"fused applies to adamw (and muon's AdamW part) only; optimizer is {self.optimizer!r} "
                "(set optimizer_impl = 'foreach')",
            )
        if self.optimizer_impl == "fused" and self.optimizer_offload != "none":
            raise ConfigError("optimizer_impl", "fused keeps AdamW's moments in memory; optimizer_offload is 'nvme'")
        if self.optimizer_offload == "nvme" and self.optimizer != "adamw":
            raise ConfigError("optimizer_offload", f"nvme offloads AdamW's state only; optimizer is {self.optimizer!r}")
        if self.optimizer_offload_chunk_mb < 0:
            raise ConfigError("optimizer_offload_chunk_mb", f"must be >= 0, got {self.optimizer_offload_chunk_mb}")
        if self.optimizer_offload == "none":
            for key in ("optimizer_offload_dir", "optimizer_offload_chunk_mb"):
                if getattr(self, key):
                    raise ConfigError(key, "is set but optimizer_offload is 'none' (set it to 'nvme' to offload)")


MUON_DEFAULTS = {f.name: f.default for f in fields(TrainConfig) if f.name.startswith("muon_")}
