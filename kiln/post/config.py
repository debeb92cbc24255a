"""Config tables of the post-training stages: `[tasks]`, `[sft]`, `[dpo]`, `[grpo]`, `[rm]`, `[ppo]`, `[distill]`,
and `[judge]` of `kiln judge`.

Each stage trains with the spine's loop, so its table only holds what differs from `[train]`:
fine-tuning learning rates, step counts and batch shapes (`train_config` merges them), plus the
stage's own objective settings.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kiln.errors import ConfigError
from kiln.train.config import MUON_DEFAULTS, OPTIMIZERS, TrainConfig

KL_ESTIMATORS = ("k1", "k2", "k3")  # kiln.post.losses.KL_ESTIMATORS, without importing torch
DISTILL_KINDS = ("forward", "reverse")  # kiln.post.losses.DISTILL_KINDS, without importing torch
TASK_FAMILIES = ("arithmetic", "sort", "reverse", "convert", "word_problem")
REWARD_ENSEMBLES = ("mean", "min", "mean_minus_std")  # kiln.post.reward_controls, without importing torch


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
    eval_batches: int = 0  # 0: every held-out example; n: a fixed sample of n batches spread over them
    ckpt_every: int = 50
    # None keeps [train].compile. Post-training batches are cut to their longest row, so their length
    # changes from step to step and a compiled model recompiles; a recipe that compiles pretraining
    # (recipes/tiny.toml) turns it off here.
    compile: bool | None = None
    # A fine-tuning default like lr, not [train]'s: the chains measured over seeds pretrain with Muon
    # or AdamW and fine-tune with AdamW (docs/benchmarks.md), and LoRA and adapters train with AdamW
    # only. A stage that names [train]'s optimizer keeps [train]'s keys for it (muon_*); any other
    # starts that optimizer's own keys from their defaults.
    optimizer: str = "adamw"

    def validate(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not 0 < self.lr < math.inf:  # also refuses NaN, which a config built in Python can hold
            raise ConfigError("lr", f"must be a positive finite number, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.weight_decay < math.inf:
            raise ConfigError("weight_decay", f"must be a finite number >= 0, got {self.weight_decay}")
        if self.global_batch_tokens < 0:
            raise ConfigError(
                "global_batch_tokens", f"must be >= 0 (0: one micro-batch per step), got {self.global_batch_tokens}"
            )
        for key in ("max_steps", "seq_len", "micro_batch_size", "eval_every", "ckpt_every"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        if self.eval_batches < 0:
            raise ConfigError("eval_batches", f"must be >= 0 (0: all held-out examples), got {self.eval_batches}")
        if not 0 <= self.warmup_steps < self.max_steps:
            raise ConfigError("warmup_steps", f"must be in [0, max_steps={self.max_steps}), got {self.warmup_steps}")

    def train_config(self, base: TrainConfig) -> TrainConfig:
        """`base` ([train]: precision, compile, ...) with this stage's keys. The loop counts
        a micro-batch as micro_batch_size examples of seq_len (a preference pair is one example)."""
        values = dataclasses.asdict(self)
        tokens = values.pop("global_batch_tokens") or self.seq_len * self.micro_batch_size
        if values["compile"] is None:
            values.pop("compile")
        if values["optimizer"] == base.optimizer:
            values.pop("optimizer")
        else:
            values.update(MUON_DEFAULTS)
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
        if not 0 < self.beta < math.inf:
            raise ConfigError("beta", f"must be a positive finite number, got {self.beta}")
        if self.loss_type not in ("sigmoid", "ipo", "cdpo"):
            raise ConfigError("loss_type", f"must be sigmoid, ipo or cdpo, got {self.loss_type!r}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}")
        if self.rejected not in ("distractor", "policy"):
            raise ConfigError("rejected", f"must be distractor or policy, got {self.rejected!r}")
        if self.rejected == "policy" and self.files:
            raise ConfigError("rejected", "'policy' builds pairs from the [tasks] answers; it cannot apply to files")
        if not 0 <= self.nll_weight < math.inf:
            raise ConfigError("nll_weight", f"must be a finite number >= 0, got {self.nll_weight}")
        try:
            self.train.validate()
        except ConfigError as err:
            raise err.within("train") from None


@dataclass
class RewardControls:
    """Reward-hacking controls shared by `[ppo]` and `[grpo]` (docs/post_rl.md, "Reward hacking").
    The reward-model keys need a learned reward; the length keys apply to any reward."""

    # How a multi-head reward model's heads become one reward: mean | min (Coste et al.'s worst-case
    # optimisation) | mean_minus_std (their uncertainty-weighted one, with uncertainty_penalty).
    reward_ensemble: str = "mean"
    uncertainty_penalty: float = 0.0  # lambda of mean_minus_std: reward = mean - lambda * std over heads
    length_penalty: float = 0.0  # subtracted per completion token beyond length_target
    length_target: int = 0  # tokens (the stop token not counted) a completion may use unpenalised
    # Every K rollout batches, fine-tune the reward model on that batch's samples labelled by the task
    # verifier (each wrong sample rejected against the prompt's answer); 0: never.
    rm_refresh_every: int = 0
    rm_refresh_steps: int = 4  # full-batch AdamW steps per refresh
    rm_refresh_lr: float = 1e-4

    def validate_controls(self, learned: bool, reward_key: str) -> None:
        """`learned`: a reward model scores the completions (named by `reward_key`)."""
        if self.reward_ensemble not in REWARD_ENSEMBLES:
            raise ConfigError(
                "reward_ensemble", f"must be one of {', '.join(REWARD_ENSEMBLES)}, got {self.reward_ensemble!r}"
            )
        if not 0 <= self.uncertainty_penalty < math.inf:
            raise ConfigError("uncertainty_penalty", f"must be a finite number >= 0, got {self.uncertainty_penalty}")
        if (self.reward_ensemble == "mean_minus_std") != (self.uncertainty_penalty > 0):
            raise ConfigError(
                "uncertainty_penalty",
                "is the lambda of reward_ensemble = mean_minus_std: it must be > 0 there and 0 otherwise",
            )
        if not 0 <= self.length_penalty < math.inf:
            raise ConfigError("length_penalty", f"must be a finite number >= 0, got {self.length_penalty}")
        if self.length_target < 0:
            raise ConfigError("length_target", f"must be >= 0 tokens, got {self.length_target}")
        if self.length_target and not self.length_penalty:
            raise ConfigError("length_target", "has no effect with length_penalty = 0")
        if self.rm_refresh_every < 0:
            raise ConfigError(
                "rm_refresh_every", f"must be >= 0 rollout batches (0: never), got {self.rm_refresh_every}"
            )
        if self.rm_refresh_steps <= 0:
            raise ConfigError("rm_refresh_steps", f"must be positive, got {self.rm_refresh_steps}")
        if not 0 < self.rm_refresh_lr < math.inf:
            raise ConfigError("rm_refresh_lr", f"must be a positive finite number, got {self.rm_refresh_lr}")
        if not learned:
            default = RewardControls()
            for key in ("reward_ensemble", "rm_refresh_every", "rm_refresh_steps", "rm_refresh_lr"):
                if getattr(self, key) != getattr(default, key):
                    raise ConfigError(key, f"acts on a learned reward model; set {reward_key} to one")
        elif not self.rm_refresh_every:
            for key in ("rm_refresh_steps", "rm_refresh_lr"):
                if getattr(self, key) != getattr(RewardControls(), key):
                    raise ConfigError(key, "only applies with rm_refresh_every > 0")


@dataclass
class GRPOConfig(RewardControls):
    group_size: int = 8  # completions sampled per prompt
    prompts_per_step: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    # Optimizer steps on each rollout batch; the ratio to the sampling policy, and so clip_eps, only
    # acts from the second one on.
    epochs: int = 1
    clip_eps: float = 0.2  # PPO-style ratio clip; needs epochs > 1 to act
    beta: float = 0.0  # KL to the frozen starting policy (k3, in the loss); 0: no reference model loaded
    loss_type: str = "grpo"  # grpo | dr_grpo | dapo
    # "" scores completions with the task verifiers; a path (an rm stage folder or its reward_model
    # export) scores them with a learned reward model instead: `kiln rm` trained it, on verifier-derived
    # task pairs by default, or on AI-judged pairs from `kiln judge` (that route is RLAIF, docs/rlaif.md).
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
        if not 0 < self.temperature < math.inf:
            raise ConfigError("temperature", f"must be a positive finite number, got {self.temperature}")
        if not 0 <= self.beta < math.inf:
            raise ConfigError(
                "beta", f"must be a finite number >= 0 (0: no KL term and no reference model), got {self.beta}"
            )
        if not 0 < self.clip_eps < 1:
            raise ConfigError("clip_eps", f"must be in (0, 1), got {self.clip_eps}")
        if self.epochs < 1:
            raise ConfigError("epochs", f"must be >= 1 (optimizer steps per rollout batch), got {self.epochs}")
        if self.epochs == 1 and self.clip_eps != GRPOConfig.clip_eps:
            raise ConfigError(
                "clip_eps",
                "has no effect with epochs = 1: the one step on a rollout batch is taken by the policy "
                "that sampled it (ratio 1); set grpo.epochs > 1 to reuse each batch",
            )
        if self.loss_type not in ("grpo", "dr_grpo", "dapo"):
            raise ConfigError("loss_type", f"must be grpo, dr_grpo or dapo, got {self.loss_type!r}")
        self.validate_controls(bool(self.reward_model), "grpo.reward_model")
        try:
            self.train.validate()
        except ConfigError as err:
            raise err.within("train") from None
        # A resumed run re-samples the current rollout batch from the checkpointed policy, which is
        # the policy that sampled it only at the batch's first step: checkpoints (periodic, and at
        # evaluations that improve) must fall between rollout batches.
        for key in ("ckpt_every", "eval_every"):
            if getattr(self.train, key) % self.epochs:
                raise ConfigError(
                    f"train.{key}", f"must be a multiple of epochs = {self.epochs}, got {getattr(self.train, key)}"
                )


@dataclass
class RMConfig:
    files: list[str] = field(default_factory=list)  # JSONL preference pairs; empty: pairs from [tasks]
    heldout_fraction: float = 0.05  # share of file pairs held out for accuracy
    margin: float = 0.0  # chosen must beat rejected by this much (0: none)
    center_coef: float = 0.0  # pulls (r_c + r_r) towards 0, keeps scores centred
    # Scalar heads on the one trunk; with several, each head's loss weighs every pair by its own
    # Poisson(1) bootstrap count (an online bootstrap of the pairs), and each head starts from its
    # own random row: an ensemble whose disagreement PPO and GRPO can read (docs/post_rl.md).
    heads: int = 1
    train: StageTrainConfig = field(
        default_factory=lambda: StageTrainConfig(lr=1e-4, max_steps=100, micro_batch_size=8)
    )

    def validate(self) -> None:
        if not 1 <= self.heads <= 64:
            raise ConfigError("heads", f"must be an integer in [1, 64], got {self.heads}")
        if not 0 < self.heldout_fraction < 0.5:
            raise ConfigError("heldout_fraction", f"must be in (0, 0.5), got {self.heldout_fraction}")
        for key in ("margin", "center_coef"):
            if not 0 <= getattr(self, key) < math.inf:
                raise ConfigError(key, f"must be a finite number >= 0, got {getattr(self, key)}")
        try:
            self.train.validate()
        except ConfigError as err:
            raise err.within("train") from None


@dataclass
class PPOConfig(RewardControls):
    files: list[str] = field(default_factory=list)  # JSONL prompts; empty: the [tasks] train split
    reward: str = "verifier"  # verifier (task graders) | rm (this run's rm stage) | a reward-model path
    critic_init: str = "policy"  # policy (the init checkpoint + a new value head) | rm | a reward-model path
    max_new_tokens: int = 16
    temperature: float = 1.0  # sampling temperature; log-probs, ratios and KL use the same one
    kl_coef: float = 0.05  # per-token KL penalty in the reward
    kl_estimator: str = "k1"  # k1 | k2 | k3
    gamma: float = 1.0
    lam: float = 0.95
    clip: float = 0.2  # policy ratio clip
    value_clip: float = 0.2  # value clip around the rollout's values
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    ppo_epochs: int = 4  # passes over each rollout batch
    minibatches: int = 2  # optimizer steps per pass; rollout batch = minibatches x step batch
    whiten_advantages: bool = True
    missing_stop_penalty: float = 0.0  # subtracted from the score of a completion cut at max_new_tokens
    train: StageTrainConfig = field(
        default_factory=lambda: StageTrainConfig(
            lr=3e-5, max_steps=64, micro_batch_size=16, warmup_steps=0, eval_every=16, ckpt_every=16
        )
    )

    @property
    def steps_per_rollout(self) -> int:
        return self.ppo_epochs * self.minibatches

    def validate(self) -> None:
        for key in ("max_new_tokens", "ppo_epochs", "minibatches"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        if not self.reward:
            raise ConfigError("reward", "must be verifier, rm or a reward-model checkpoint path")
        if not self.critic_init:
            raise ConfigError("critic_init", "must be policy, rm or a reward-model checkpoint path")
        if not 0 < self.temperature < math.inf:
            raise ConfigError(
                "temperature",
                f"must be a positive finite number (PPO needs the sampling distribution's log-probs), "
                f"got {self.temperature}",
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError("kl_estimator", f"must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(key, f"must be in [0, 1], got {getattr(self, key)}")
        for key in ("clip", "value_clip", "vf_coef"):
            if not 0 < getattr(self, key) < math.inf:
                raise ConfigError(key, f"must be a positive finite number, got {getattr(self, key)}")
        for key in ("kl_coef", "entropy_coef", "missing_stop_penalty"):
            if not 0 <= getattr(self, key) < math.inf:
                raise ConfigError(key, f"must be a finite number >= 0, got {getattr(self, key)}")
        self.validate_controls(self.reward != "verifier", "ppo.reward")
        try:
            self.train.validate()
        except ConfigError as err:
            raise err.within("train") from None
        # Checkpoints (periodic, and at evaluations that improve) must fall between rollout batches:
        # a resumed run regenerates the current batch from the checkpointed policy, which is only the
        # policy that sampled it at the start of a cycle.
        for key in ("ckpt_every", "eval_every"):
            if getattr(self.train, key) % self.steps_per_rollout:
                raise ConfigError(
                    f"train.{key}",
                    f"must be a multiple of ppo_epochs * minibatches = "
                    f"{self.steps_per_rollout}, got {getattr(self.train, key)}",
                )


@dataclass
class DistillConfig:
    teacher: str = ""  # teacher checkpoint: folder, checkpoints root or stage folder (required)
    data: str = "teacher"  # teacher: the teacher's answers to the prompts | answers: reference answers
    files: list[str] = field(default_factory=list)  # JSONL prompts (data=teacher) or conversations (answers)
    tasks: bool = True  # also use the [tasks] train split
    samples_per_prompt: int = 1
    gen_temperature: float = 0.0  # 0: the teacher's greedy answer
    max_new_tokens: int = 16
    filter_correct: bool = False  # keep only teacher answers the task grader accepts
    kind: str = "forward"  # forward KL(teacher || student) | reverse KL(student || teacher)
    temperature: float = 1.0  # softening temperature of both distributions in the KL
    alpha: float = 0.5  # weight of the KL; 1 - alpha on the cross entropy
    packing: bool = True
    train: StageTrainConfig = field(default_factory=lambda: StageTrainConfig(lr=1e-3, max_steps=200))

    def validate(self) -> None:
        # An empty teacher is valid here (every recipe validates [distill], most never run it); the
        # stage itself refuses to start without one.
        if self.data not in ("teacher", "answers"):
            raise ConfigError("data", f"must be teacher or answers, got {self.data!r}")
        if not self.files and not self.tasks:
            raise ConfigError("files", "no prompts: give JSONL files or set tasks = true")
        if self.kind not in DISTILL_KINDS:
            raise ConfigError("kind", f"must be one of {', '.join(DISTILL_KINDS)}, got {self.kind!r}")
        for key in ("samples_per_prompt", "max_new_tokens"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        if self.samples_per_prompt > 1 and self.gen_temperature == 0:
            raise ConfigError(
                "samples_per_prompt",
                "several samples per prompt need gen_temperature > 0 (greedy answers are all the same)",
            )
        if not 0 <= self.gen_temperature < math.inf:
            raise ConfigError(
                "gen_temperature", f"must be a finite number >= 0 (0 is greedy), got {self.gen_temperature}"
            )
        if not 0 < self.temperature < math.inf:
            raise ConfigError("temperature", f"must be a positive finite number, got {self.temperature}")
        if not 0 <= self.alpha <= 1:
            raise ConfigError("alpha", f"must be in [0, 1], got {self.alpha}")
        try:
            self.train.validate()
        except ConfigError as err:
            raise err.within("train") from None


JUDGE_BACKENDS = ("kiln", "openai")


@dataclass
class JudgeConfig:
    """`kiln judge`: an AI judge ranks two completions per prompt against a written rubric, in both
    orders, and writes the pairs it is consistent about as preference pairs (docs/rlaif.md)."""

    rubric: str = ""  # the constitution: principles the judge applies, inline
    rubric_file: str = ""  # ... or a UTF-8 text file holding them (exactly one of the two)
    backend: str = "kiln"  # kiln: a Kiln checkpoint, by log p("A") vs log p("B") | openai: an OpenAI-compatible API
    checkpoint: str = ""  # kiln: the judge checkpoint (folder, checkpoints root or stage folder)
    tokenizer: str = ""  # kiln: the judge's tokenizer.json ("": found beside the checkpoint)
    device: str = "auto"  # the kiln judge's and the policy's: cpu, cuda, cuda:1, ... (auto: cuda when available)
    batch_size: int = 8  # kiln: judging prompts per forward pass
    base_url: str = ""  # openai: the API root, e.g. http://localhost:8000/v1 ("": $OPENAI_BASE_URL)
    model: str = ""  # openai: the served model's name
    api_key_env: str = "OPENAI_API_KEY"  # openai: the environment variable that holds the API key
    tie_margin: float = 0.0  # a verdict with |log p(A) - log p(B)| <= tie_margin is a tie
    candidates: list[str] = field(default_factory=list)  # JSONL {"prompt", "completion_a", "completion_b"}
    policy: str = ""  # ... or sample two completions per prompt from this checkpoint
    prompts: list[str] = field(default_factory=list)  # policy: JSONL {"prompt"} files
    max_new_tokens: int = 64  # policy: the samples' length limit
    temperature: float = 1.0  # policy: sampling temperature (> 0, or both samples are the same)
    seed: int = 0  # policy: sample i of the run draws with seed + i
    out: str = "judged.jsonl"  # the kept pairs, {"prompt", "chosen", "rejected"} as `kiln rm`/`kiln dpo` read

    def validate(self) -> None:
        if bool(self.rubric.strip()) == bool(self.rubric_file):
            raise ConfigError("rubric", "give the principles inline (rubric) or in a file (rubric_file), not both")
        if self.backend not in JUDGE_BACKENDS:
            raise ConfigError("backend", f"must be one of {', '.join(JUDGE_BACKENDS)}, got {self.backend!r}")
        backend_keys = {
            "kiln": ("checkpoint", "tokenizer", "batch_size"),
            "openai": ("base_url", "model", "api_key_env"),
        }
        for backend, keys in backend_keys.items():
            if backend != self.backend:
                self._refuse_set(keys, f"only applies with backend = {backend!r}")
        if self.backend == "openai" and not self.policy:
            self._refuse_set(("device",), "places a Kiln checkpoint: the kiln backend's judge or the policy")
        if self.backend == "kiln" and not self.checkpoint:
            raise ConfigError("checkpoint", "the kiln backend needs the judge checkpoint")
        if self.backend == "openai" and not self.model:
            raise ConfigError("model", "the openai backend needs the served model's name")
        if self.batch_size <= 0:
            raise ConfigError("batch_size", f"must be positive, got {self.batch_size}")
        if not 0 <= self.tie_margin < math.inf:  # also refuses NaN
            raise ConfigError("tie_margin", f"must be >= 0 and finite, got {self.tie_margin}")
        if bool(self.candidates) == bool(self.policy):
            raise ConfigError("candidates", "give candidate files or a policy checkpoint to sample them, not both")
        if self.policy:
            if not self.prompts:
                raise ConfigError("prompts", "a policy needs JSONL prompt files to answer")
            if self.max_new_tokens <= 0:
                raise ConfigError("max_new_tokens", f"must be positive, got {self.max_new_tokens}")
            if not 0 < self.temperature < math.inf:  # also refuses NaN
                raise ConfigError(
                    "temperature",
                    f"must be a positive finite number (greedy samples are identical), got {self.temperature}",
                )
        else:
            self._refuse_set(("prompts", "max_new_tokens", "temperature", "seed"), "only applies with a policy")
        if not self.out:
            raise ConfigError("out", "must name the output JSONL file")

    def _refuse_set(self, keys: tuple[str, ...], why: str) -> None:
        """A key that does nothing in this configuration is refused rather than ignored."""
        default = JudgeConfig()
        for key in keys:
            if getattr(self, key) != getattr(default, key):
                raise ConfigError(key, why)
