"""`kiln ppo`: PPO with an actor, a critic, a frozen reference and a reward (verifier or learned RM).

One rollout cycle (see docs/post_rl.md):
1. Sample one completion per prompt from the actor with the KV-cache engine at `temperature`.
2. Score it: the task grader (`reward = "verifier"`) or a reward model's value at the last token.
3. Recompute, in one forward each and at the same temperature, the actor's log-probs (the "old"
   log-probs), the reference's and the critic's values, under the training precision: the first
   minibatch then has ratio exactly 1 and the KL to the reference starts at exactly 0 (the
   engine's own log-probs are compared with these and the largest gap is logged).
4. Per-token reward -kl_coef * KL_k (k1 by default) with the score added at the last completion
   token; GAE(gamma, lambda) gives advantages and returns; advantages are whitened over the batch.
5. `ppo_epochs` passes over the buffer in `minibatches` shuffled minibatches, one optimizer step
   each, minimising clipped policy loss + vf_coef * clipped value loss (- entropy_coef * entropy).

The actor trains through the spine's Trainer (the driver, kiln.post.driver, runs the `PPO` stage
below on it). The critic is attached to the actor model as the submodule `critic`
(`prepare_model`), so one optimizer updates both, every checkpoint holds both and resume restores
both; the stage then writes the actor alone, LoRA merged, to `<out>/policy`, a plain weights
checkpoint for sampling, export or the next stage (a training checkpoint of this stage has the
extra `critic.*` tensors and does not load as a plain Transformer). Batches come from an
OnlineSource bound to the Trainer, whose batch index says which cycle, epoch and minibatch to
serve; checkpoints fall on cycle boundaries (checked), so a resumed run regenerates exactly the
rollouts it would have had. The last cycle's statistics are logged by the Trainer's after-fit hook.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.checkpoint import save_weights
from kiln.data.chat import render_prompt
from kiln.errors import ConfigError
from kiln.infer.engine import Engine
from kiln.peft.apply import apply_peft
from kiln.peft.load import load_model
from kiln.peft.peft_io import merged_state_dict
from kiln.post.config import PPOConfig
from kiln.post.data import read_prompts
from kiln.post.evaluate import rollout_logprobs
from kiln.post.losses import (
    gae,
    kl_estimate,
    masked_mean,
    ppo_policy_loss,
    ppo_value_loss,
    token_entropy,
    token_logprobs,
    whiten,
)
from kiln.post.outputs import save_adapter
from kiln.post.protocol import Stage
from kiln.post.reward_controls import RewardFn, ShapedReward, verifier_reward
from kiln.post.rm import attach_scalar_head, load_scalar_model
from kiln.post.rows import IGNORE
from kiln.post.sft import reference_answer_batches, sft_loss
from kiln.post.sources import OnlineSource
from kiln.train.precision import autocast

POLICY_DIR = "policy"


# ---- rollouts --------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One rollout batch, [N, T] per token (aligned with `targets`: position t holds the quantities
    of the token targets[:, t], predicted from the state inputs[:, :t+1])."""

    inputs: torch.Tensor
    targets: torch.Tensor  # completion tokens; IGNORE on prompt and padding
    logprobs: torch.Tensor  # actor at rollout time ("old" log-probs)
    ref_logprobs: torch.Tensor
    values: torch.Tensor  # critic at rollout time
    rewards: torch.Tensor  # -kl_coef * KL, plus the score at the last completion token
    advantages: torch.Tensor  # GAE, whitened when configured
    returns: torch.Tensor
    scores: torch.Tensor  # [N] sequence scores (after the missing-stop penalty)
    kl: torch.Tensor  # [N, T] per-token KL estimate
    stats: dict

    @property
    def mask(self) -> torch.Tensor:
        return self.targets != IGNORE

    def training_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.inputs, self.targets, self.logprobs, self.values, self.advantages, self.returns)


def critic_of(model) -> torch.nn.Module:
    return getattr(model, "module", model).critic


def _layout(prompts, completions, outs, pad: int, seq_len: int):
    """[N, seq_len] inputs, targets (the completion tokens) and the engine's tempered log-probs of
    them, and the position of each completion's last token."""
    n = len(prompts)
    inputs = torch.full((n, seq_len), pad, dtype=torch.long)
    targets = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    engine_logp = torch.zeros(n, seq_len)
    last = []
    for i, (p, c, o) in enumerate(zip(prompts, completions, outs)):
        ids = p + c
        if len(ids) > seq_len + 1:
            raise ConfigError(
                "ppo.train.seq_len",
                f"prompt ({len(p)} tokens) + completion ({len(c)}) exceeds seq_len + 1 = {seq_len + 1}",
            )
        inputs[i, : len(ids) - 1] = torch.tensor(ids[:-1])
        # targets[t] = ids[t + 1]: the completion's first token is predicted at the prompt's last position.
        targets[i, len(p) - 1 : len(ids) - 1] = torch.tensor(c)
        engine_logp[i, len(p) - 1 : len(ids) - 1] = torch.tensor(o.temperature_logprobs)
        last.append(len(ids) - 2)
    return inputs, targets, engine_logp, torch.tensor(last)


def _recompute(actor, reference, critic, inputs, targets, temperature: float, precision: str):
    """Actor and reference log-probs and critic values, each in one forward under the training
    precision, as the loss will compute them."""
    logp = rollout_logprobs(actor, inputs, targets, temperature, precision)
    ref_logp = rollout_logprobs(reference, inputs, targets, temperature, precision)
    device = next(critic.parameters()).device
    was_training = critic.training
    critic.eval()
    try:
        with autocast(precision, device):
            values = critic(inputs.to(device))[..., 0].float().cpu()
    finally:
        critic.train(was_training)
    return logp, ref_logp, values


@torch.no_grad()
def make_rollout(
    actor,
    critic,
    reference,
    tokenizer,
    examples: list[dict],
    prompts: list[list[int]],
    reward_fn: RewardFn,
    cfg: PPOConfig,
    seq_len: int,
    seed: int,
    precision: str = "fp32",
) -> Rollout:
    stop = (tokenizer.token_id("<|end|>"), tokenizer.eot_id)
    outs = Engine(actor).generate(
        prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, stop_token_ids=stop, seed=seed
    )
    completions = [list(o.ids) for o in outs]
    n = len(prompts)
    inputs, targets, engine_logp, last = _layout(prompts, completions, outs, tokenizer.token_id("<|pad|>"), seq_len)
    mask = targets != IGNORE
    logp, ref_logp, values = _recompute(actor, reference, critic, inputs, targets, cfg.temperature, precision)

    scores = torch.as_tensor(reward_fn(examples, prompts, completions), dtype=torch.float32).reshape(n)
    stopped = torch.tensor([bool(c) and c[-1] in stop for c in completions])
    scores = scores - cfg.missing_stop_penalty * (~stopped).float()
    kl = kl_estimate(logp, ref_logp, cfg.kl_estimator, mask)
    rewards = -cfg.kl_coef * kl
    rewards[torch.arange(n), last] += scores
    values = torch.where(mask, values, torch.zeros(()))
    advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = whiten(advantages, mask)
    stats = {
        "score": scores.mean().item(),
        "kl": (kl.sum(-1)).mean().item(),
        "kl_per_token": masked_mean(kl, mask).item(),
        "length": mask.sum(-1).float().mean().item(),
        "stopped": stopped.float().mean().item(),
        "value_error": masked_mean((values - returns) ** 2, mask).item(),
        # Engine (KV cache, fp32) vs the recomputed log-probs: a temperature or position
        # mismatch shows here as a large gap long before it shows as a negative KL.
        "logprob_gap": (engine_logp - logp).abs().masked_fill(~mask, 0).max().item(),
    }
    return Rollout(inputs, targets, logp, ref_logp, values, rewards, advantages, returns, scores, kl, stats)


# ---- the objective ---------------------------------------------------------------------------------


def make_ppo_loss(cfg: PPOConfig, sink: list | None = None):
    """loss_fn(model, batch) -> (policy loss + vf_coef * value loss - entropy_coef * entropy, rows).
    Each call appends its detached statistics to `sink`."""

    def loss_fn(model, batch: tuple) -> tuple[torch.Tensor, int]:
        inputs, targets, old_logp, old_values, advantages, returns = batch
        logits = model(inputs)
        values = critic_of(model)(inputs)[..., 0]
        mask = targets != IGNORE
        logp = token_logprobs(logits, targets, cfg.temperature)
        policy_loss, clip_fraction, approx_kl = ppo_policy_loss(logp, old_logp, advantages, mask, cfg.clip)
        value_loss = ppo_value_loss(values, old_values, returns, mask, clip=cfg.value_clip)
        # The entropy's [B, T, V] graph is only kept when it is part of the objective.
        entropy = masked_mean(token_entropy(logits if cfg.entropy_coef else logits.detach(), cfg.temperature), mask)
        loss = policy_loss + cfg.vf_coef * value_loss - cfg.entropy_coef * entropy
        if sink is not None:
            value_error = masked_mean((values.detach().float() - returns) ** 2, mask)
            sink.append(
                torch.stack(
                    [policy_loss.detach(), value_loss.detach(), clip_fraction, approx_kl, entropy.detach(), value_error]
                ).float()
            )
        return loss, inputs.shape[0]

    return loss_fn


LOSS_STATS = ("policy_loss", "value_loss", "clip_fraction", "approx_kl", "entropy", "value_error")


# ---- models, rewards and prompts -------------------------------------------------------------------


def _resolve(recipe, value: str, key: str) -> Path:
    """A reward-model setting: "rm" names this run's rm stage folder, anything else is a path."""
    if value == "rm":
        path = recipe.run_dir / "rm"
        if not path.exists():
            raise ConfigError(
                key,
                f"'rm' names this run's rm stage, but {path} does not exist (add rm to "
                f"run.stages before ppo, or give a reward-model checkpoint path)",
            )
        return path
    return Path(value)


def build_critic(recipe, cfg: PPOConfig, init: Path) -> torch.nn.Module:
    if cfg.critic_init == "policy":
        critic, _ = load_model(init)
        attach_scalar_head(critic)
        return critic.train()
    critic = load_scalar_model(_resolve(recipe, cfg.critic_init, "ppo.critic_init"), "ppo.critic_init")
    if critic.output.weight.shape[0] != 1:
        raise ConfigError(
            "ppo.critic_init", "a multi-head reward model cannot start the critic, which has one value head"
        )
    return critic.train()


def _prompts(recipe, cfg: PPOConfig, tokenizer, out: Path, tasks: list[dict]) -> tuple[list[dict], list[list[int]]]:
    """(examples, rendered prompt ids) from ppo.files, else the [tasks] train split."""
    if cfg.files:
        examples, _ = read_prompts(cfg.files, rejected_path=out / "rejected.jsonl")
        if cfg.reward == "verifier" and any(ex.get("answer") is None for ex in examples):
            raise ConfigError(
                "ppo.reward",
                "the verifier grades against each prompt's answer; some prompts in "
                "ppo.files have none (give answers or use a reward model)",
            )
        return examples, [render_prompt(tokenizer, ex["messages"]) for ex in examples]
    return tasks, [render_prompt(tokenizer, [{"role": "user", "content": ex["prompt"]}]) for ex in tasks]


# ---- rollout cycles --------------------------------------------------------------------------------


class Cycles:
    """The OnlineSource's batch function: serves the minibatches of one rollout cycle after another
    from the batch index, and logs each cycle's rollout and optimisation statistics."""

    def __init__(self, recipe, cfg: PPOConfig, tokenizer, examples, prompts, reward_fn, reference):
        self.recipe, self.cfg, self.tokenizer = recipe, cfg, tokenizer
        self.examples, self.prompts, self.reward_fn = examples, prompts, reward_fn
        self.reference, self.sink = reference, []
        self.cycle, self.buffer, self.history = None, None, []

    def __call__(self, trainer, batch_index: int, _seed: int) -> tuple[torch.Tensor, ...]:
        cfg, micro = self.cfg, trainer.cfg.micro_batch_size
        per_epoch = cfg.minibatches * trainer.accum_steps  # micro-batches in one pass over the buffer
        cycle, position = divmod(batch_index, cfg.ppo_epochs * per_epoch)
        if cycle != self.cycle:
            self.flush(trainer)
            self.buffer = self._rollout(trainer, cycle, micro * per_epoch)
            self.cycle = cycle
        epoch, index = divmod(position, per_epoch)
        g = torch.Generator().manual_seed(self._seed(cycle) + epoch)
        rows = torch.randperm(self.buffer[0].shape[0], generator=g)[index * micro : (index + 1) * micro]
        return tuple(t[rows] for t in self.buffer)

    def _seed(self, cycle: int) -> int:
        return (self.recipe.train.seed * 1_000_003 + cycle) * 4099

    def _rollout(self, trainer, cycle: int, n: int) -> tuple[torch.Tensor, ...]:
        rng = random.Random(f"kiln-ppo|{self.recipe.train.seed}|{cycle}")
        total = len(self.prompts)
        picked = rng.sample(range(total), n) if n <= total else [rng.randrange(total) for _ in range(n)]
        model = trainer.model
        self.reward_fn.begin(cycle)
        rollout = make_rollout(
            model,
            critic_of(model),
            self.reference,
            self.tokenizer,
            [self.examples[i] for i in picked],
            [self.prompts[i] for i in picked],
            self.reward_fn,
            self.cfg,
            trainer.cfg.seq_len,
            self._seed(cycle),
            trainer.cfg.precision,
        )
        record = {"kind": "rollout", "step": trainer.step, "cycle": cycle, **rollout.stats, **self.reward_fn.stats}
        self.history.append(record)
        if trainer.metrics:
            trainer.metrics.log(record)
        refresh = self.reward_fn.end(cycle)
        if refresh is not None:
            record["rm_refresh"] = refresh
            if trainer.metrics:
                trainer.metrics.log({"kind": "rm_refresh", "step": trainer.step, **refresh})
        return rollout.training_tensors()

    def flush(self, trainer) -> None:
        """Log the mean optimisation statistics of the cycle that just ended."""
        if not self.sink:
            return
        means = torch.stack(self.sink).mean(0).tolist()
        self.sink.clear()
        record = {"kind": "ppo", "step": trainer.step, "cycle": self.cycle, **dict(zip(LOSS_STATS, means))}
        if self.history and self.history[-1].get("cycle") == self.cycle:
            self.history[-1].update({k: v for k, v in record.items() if k not in ("kind", "step")})
        if trainer.metrics:
            trainer.metrics.log(record)


# ---- the stage -------------------------------------------------------------------------------------


class PPO(Stage):
    """reward_fn overrides the configured reward (e.g. a custom verifier)."""

    name = "ppo"

    def __init__(self, recipe, out, init, tokenizer, reward_fn: RewardFn | None = None):
        super().__init__(recipe, out, init, tokenizer)
        self.reward_fn, self.reward_model = reward_fn, None
        self.reward_name = "custom" if reward_fn is not None else self.cfg.reward

    def sources(self) -> tuple[OnlineSource, OnlineSource]:
        cfg, tokenizer = self.cfg, self.tokenizer
        examples, prompts = _prompts(self.recipe, cfg, tokenizer, self.out, self.train_tasks)
        longest = max(map(len, prompts))
        if longest + cfg.max_new_tokens > cfg.train.seq_len + 1:
            raise ConfigError(
                "ppo.train.seq_len",
                f"the longest prompt ({longest} tokens) + max_new_tokens ({cfg.max_new_tokens}) must fit in seq_len + 1",
            )
        if self.reward_fn is not None:
            reward_fn = ShapedReward(cfg, tokenizer, "ppo.reward", base=self.reward_fn, out=self.out)
        else:
            reward_fn = self._configured_reward()
        reward_fn.check_gold(examples)
        self.shaped = reward_fn
        self.reference = self.reference_model()
        self.cycles = Cycles(self.recipe, cfg, tokenizer, examples, prompts, reward_fn, self.reference)
        # 64 held-out problems spread over the families, which come in blocks.
        sampled = self.heldout[:: max(1, len(self.heldout) // 64)][:64]
        val = reference_answer_batches(tokenizer, sampled, cfg.train.seq_len)
        source = OnlineSource(
            self.cycles, seed=self.recipe.train.seed, val_batches=val, vocab_size=tokenizer.vocab_size
        )
        return source, source

    def _configured_reward(self) -> ShapedReward:
        if self.cfg.reward == "verifier":
            return ShapedReward(self.cfg, self.tokenizer, "ppo.reward", base=verifier_reward(self.tokenizer))
        self.reward_model = load_scalar_model(_resolve(self.recipe, self.cfg.reward, "ppo.reward"), "ppo.reward")
        if self.reward_model.cfg.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                "ppo.reward",
                f"reward model vocabulary {self.reward_model.cfg.vocab_size} < the "
                f"tokenizer's {self.tokenizer.vocab_size} (same tokenizer needed)",
            )
        return ShapedReward(self.cfg, self.tokenizer, "ppo.reward", model=self.reward_model, out=self.out)

    def loss_fn(self):
        return make_ppo_loss(self.cfg, self.cycles.sink)

    def eval_loss_fn(self):
        return sft_loss  # validation: the SFT loss of the held-out reference answers, a policy-only measure

    def prepare_model(self, model) -> None:
        if self.peft is not None:
            apply_peft(model, self.peft)  # the actor only: the critic, attached after, trains fully
        critic = build_critic(self.recipe, self.cfg, self.init).to(next(model.parameters()).device)
        if critic.cfg.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                "ppo.critic_init",
                f"critic vocabulary {critic.cfg.vocab_size} < the tokenizer's "
                f"{self.tokenizer.vocab_size} (same tokenizer needed)",
            )
        model.add_module("critic", critic)

    def start(self, trainer) -> None:
        if trainer.world_size > 1:
            raise ConfigError("parallel", "ppo runs in one process: rollouts sample from the whole actor")
        self.reference.to(trainer.device)
        if self.reward_model is not None:
            self.reward_model.to(trainer.device)
        self.shaped.start(trainer.resumed_from is not None)

    def after_fit(self, trainer) -> None:
        self.cycles.flush(trainer)  # the last cycle's optimisation statistics

    def results(self, trainer, summary: dict, before: dict | None) -> dict:
        after = self.evaluate(trainer.model)
        return {
            "train": summary,
            "rollouts": self.cycles.history,
            "heldout_before": before,
            "heldout_after": after,
            "reward": self.reward_name,
            **({"rm_refreshes": self.shaped.refreshes} if self.cfg.rm_refresh_every else {}),
        }

    def export(self, trainer, stats: dict) -> dict:
        """`<out>/policy`: the actor alone, LoRA merged; with [peft], the actor's adapter too."""
        extra = {"stage": "ppo", "checkpoint": stats["train"]["checkpoint"]}
        outputs = {"policy": str(export_policy(trainer.model, trainer.model_cfg, self.out / POLICY_DIR, extra))}
        if self.peft is not None:
            outputs["peft"] = export_adapter(trainer.model, trainer.model_cfg, self.peft, self.out / "adapter")
        return outputs

    def closing_lines(self, stats: dict) -> list[str]:
        before, after = stats["heldout_before"], stats["heldout_after"]
        line = f"[{self.out.name}] held-out task accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
        if self.cycles.history:
            first, final = self.cycles.history[0], self.cycles.history[-1]
            line += (
                f"; rollout score {first['score']:.3f} -> {final['score']:.3f}, "
                f"KL {first['kl']:.2e} -> {final['kl']:.2e}"
            )
        return [line]


def export_adapter(model, model_cfg, peft_cfg, folder: Path) -> dict:
    """The actor's small trainable weights: PEFT format for LoRA/QLoRA, Kiln's own for adapters.
    The critic holds no PEFT layers, so neither writer sees it."""
    save_adapter(model, model_cfg, peft_cfg, folder)
    return {"method": peft_cfg.method, "adapter": str(folder)}


def export_policy(model, model_cfg, folder: Path, extra: dict) -> Path:
    """The actor alone (no `critic.*`), LoRA merged: a plain checkpoint `load_model` reads."""
    try:
        state = merged_state_dict(model)
    except ValueError:
        # Bottleneck adapters cannot be folded in: the export keeps them (load with adapters applied).
        state = model.state_dict()
    state = {k: v for k, v in state.items() if not k.startswith("critic.")}
    return save_weights(folder, model_cfg, state, extra)
