"""Config tables of the post-training stages: `[tasks]`, `[sft]`, `[dpo]`, `[grpo]`.

Each stage trains with the spine's loop, so its table only holds what differs from `[train]`:
fine-tuning learning rates, step counts and batch shapes (`train_config` merges them), plus the
stage's own objective settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kiln.errors import ConfigError
from kiln.train.config import TrainConfig

TASK_FAMILIES = ("arithmetic", "sort", "reverse", "convert", "word_problem")


@dataclass
class TaskConfig:
    """Kiln's verifiable tasks: SFT data, preference pairs, RL prompts and the held-out evaluation."""

    families: list[str] = field(default_factory=lambda: ["arithmetic", "reverse", "sort"])
    difficulty: int = 1
    train_per_family: int = 2000
    heldout_per_family: int = 100
    seed: int = 0

    def validate(self) -> None:
        unknown = [f for f in self.families if f not in TASK_FAMILIES]
        if not self.families or unknown:
            raise ConfigError(
                "families", f"must be a non-empty list of {', '.join(TASK_FAMILIES)}, got {self.families}"
            )
        if self.difficulty not in (1, 2, 3):
            raise ConfigError("difficulty", f"must be 1, 2 or 3, got {self.difficulty}")
        for key in ("train_per_family", "heldout_per_family"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")


@dataclass
class StageTrainConfig:
    """The [train] keys a post-training stage sets for itself (fine-tuning defaults)."""

    lr: float = 1e-4
    max_steps: int = 200
    warmup_steps: int = 10
    min_lr_ratio: float = 0.0
    seq_len: int = 64
    micro_batch_size: int = 16
    global_batch_tokens: int = 0  # 0: one micro-batch per step on every data-parallel rank
    weight_decay: float = 0.0
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 50
    # None keeps [train].compile. Post-training batches are cut to their longest row, so their length
    # changes from step to step and a compiled model recompiles; a recipe that compiles pretraining
    # (recipes/tiny.toml) turns it off here.
    compile: bool | None = None

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError("lr", f"must be positive, got {self.lr}")
        for key in ("max_steps", "seq_len", "micro_batch_size", "eval_every", "eval_batches", "ckpt_every"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        if not 0 <= self.warmup_steps < self.max_steps:
            raise ConfigError("warmup_steps", f"must be in [0, max_steps={self.max_steps}), got {self.warmup_steps}")

    def train_config(self, base: TrainConfig) -> TrainConfig:
        """`base` ([train]: precision, optimizer, compile, ...) with this stage's keys. The loop counts
        a micro-batch as micro_batch_size examples of seq_len (a preference pair is one example)."""
        values = dataclasses.asdict(self)
        tokens = values.pop("global_batch_tokens") or self.seq_len * self.micro_batch_size
        if values["compile"] is None:
            values.pop("compile")
        # Pretraining's batch ramp is sized in pretraining tokens; a fine-tuning stage runs at its own batch.
        return dataclasses.replace(
            base, **values, global_batch_tokens=tokens, schedule="cosine", batch_ramp_steps=0, batch_ramp_start_tokens=0
        )


@dataclass
class SFTConfig:
    files: list[str] = field(default_factory=list)  # JSONL conversations; empty: the [tasks] train split
    tasks: bool = True  # also train on the verifiable tasks
    packing: bool = True  # several conversations per row, document-masked
    train: StageTrainConfig = field(default_factory=lambda: StageTrainConfig(lr=1e-3, max_steps=300))

    def validate(self) -> None:
        if not self.files and not self.tasks:
            raise ConfigError("files", "no data: give JSONL files or set tasks = true")
        try:
            self.train.validate()
        except ConfigError as err:
            raise err.within("train") from None


@dataclass
class DPOConfig:
    files: list[str] = field(default_factory=list)  # JSONL preference pairs; empty: pairs from [tasks]
    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid | ipo | cdpo (label-smoothed sigmoid)
    label_smoothing: float = 0.1  # cdpo only: assumed share of flipped labels
    # Task pairs: "distractor" rejects one of the task's plausible wrong answers; "policy" rejects
    # the starting model's own greedy answer where it is wrong (on-policy pairs aimed at its errors).
    rejected: str = "distractor"
    nll_weight: float = 0.0  # RPO: + weight x per-token NLL of the chosen answers
    rejected_to_divergence: bool = False  # score a rejected answer only up to its first wrong token
    train: StageTrainConfig = field(
        default_factory=lambda: StageTrainConfig(lr=1e-4, max_steps=100, micro_batch_size=8)
    )

    def validate(self) -> None:
        if self.beta <= 0:
            raise ConfigError("beta", f"must be positive, got {self.beta}")
        if self.loss_type not in ("sigmoid", "ipo", "cdpo"):
            raise ConfigError("loss_type", f"must be sigmoid, ipo or cdpo, got {self.loss_type!r}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}")
        if self.rejected not in ("distractor", "policy"):
            raise ConfigError("rejected", f"must be distractor or policy, got {self.rejected!r}")
        if self.rejected == "policy" and self.files:
            raise ConfigError("rejected", "'policy' builds pairs from the [tasks] answers; it cannot apply to files")
        if self.nll_weight < 0:
            raise ConfigError("nll_weight", f"must be >= 0, got {self.nll_weight}")
        try:
            self.train.validate()
        except ConfigError as err:
            raise err.within("train") from None


@dataclass
class GRPOConfig:
    group_size: int = 8  # completions sampled per prompt
    prompts_per_step: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    clip_eps: float = 0.2
    beta: float = 0.0  # KL to the reference (k3 estimator); 0 = no reference model
    loss_type: str = "grpo"  # grpo | dr_grpo | dapo
    # RLAIF: "" scores completions with the task verifiers; a path (an rm stage folder or its
    # reward_model export) lets a learned reward model judge them instead.
    reward_model: str = ""
    # RL prompts: train-split problems of [tasks] generated with this seed instead of tasks.seed, so
    # the policy practises problems SFT did not train on (None: the SFT problems).
    prompt_seed: int | None = None
    train: StageTrainConfig = field(
        default_factory=lambda: StageTrainConfig(lr=5e-5, max_steps=60, eval_every=20, ckpt_every=20)
    )

    def validate(self) -> None:
        for key in ("group_size", "prompts_per_step", "max_new_tokens"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        if self.group_size < 2:
            raise ConfigError("group_size", "needs at least 2 completions per prompt to normalise rewards")
        if self.temperature <= 0:
            raise ConfigError("temperature", f"must be positive, got {self.temperature}")
        if self.beta < 0 or self.clip_eps <= 0:
            raise ConfigError("beta" if self.beta < 0 else "clip_eps", "out of range")
        if self.loss_type not in ("grpo", "dr_grpo", "dapo"):
            raise ConfigError("loss_type", f"must be grpo, dr_grpo or dapo, got {self.loss_type!r}")
        try:
            self.train.validate()
        except ConfigError as err:
            raise err.within("train") from None
