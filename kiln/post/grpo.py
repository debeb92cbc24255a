"""`kiln grpo`: group-relative policy optimisation on verifiable tasks (see docs/post.md).

Each rollout batch holds `prompts_per_step` [tasks] prompts, `group_size` completions each, sampled
from the live policy (the stage's OnlineSource is bound to the Trainer) with the KV-cache engine,
seeded by its index so a resumed run samples the same rollouts. Rewards come from the task graders, or, with
`reward_model` set, from a learned reward model trained by `kiln rm`. Advantages are rewards
normalised within each group. The objective is DeepSeekMath's GRPO (kiln.post.losses.grpo_loss):
the clipped ratio to the policy that sampled, minus `beta` times the k3 estimate of the per-token
KL to a frozen reference, the stage's starting weights. The reference is loaded, and run once per
rollout batch, only when `beta` > 0. Each rollout batch serves `epochs` optimizer steps: the old
log-probs are recorded at sampling time (under the training precision, so the first step's ratio
is 1), and from the second step on the ratio and `clip_eps` act; with `epochs = 1` the old policy
is the current one and no extra forward is run. Checkpoints fall between rollout batches
(checked), so a resumed run re-samples from the policy that sampled. Token log-probs use the
sampling temperature, as the rollouts did. Each rollout batch's mean reward, clip fraction and KL
are logged (`kind = "grpo"`) and averaged over the run in stats.json. Validation: the SFT loss of
held-out reference answers. Measured: held-out task accuracy before and after. [peft] and its
outputs as in SFT; the driver (kiln.post.driver) runs these parts on the shared Trainer.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from kiln.data.chat import render_prompt
from kiln.errors import ConfigError
from kiln.post.config import GRPOConfig
from kiln.post.evaluate import complete, rollout_logprobs
from kiln.post.losses import group_advantages, grpo_loss, token_logprobs
from kiln.post.protocol import Stage
from kiln.post.reward_controls import ShapedReward, verifier_reward
from kiln.post.rm import load_scalar_model
from kiln.post.rows import IGNORE, pad
from kiln.post.sft import reference_answer_batches, sft_loss
from kiln.post.sources import OnlineSource
from kiln.post.tasks import train_tasks


def rl_prompts(recipe) -> list[dict]:
    """GRPO's prompt pool: [tasks] train-split problems, drawn with grpo.prompt_seed when it is set
    (problems SFT did not see; the split hash keeps them out of the held-out set either way)."""
    seed = recipe.grpo.prompt_seed
    return train_tasks(recipe.tasks if seed is None else dataclasses.replace(recipe.tasks, seed=seed))


def make_grpo_loss(cfg: GRPOConfig, sink: list | None = None):
    """loss_fn(model, batch) -> (the GRPO loss of a rollout batch, its rows). The batch carries the
    sampling policy's log-probs when cfg.epochs > 1 (else the step is on-policy: ratio 1) and the
    reference's when cfg.beta > 0. Each call appends its detached clip fraction, ratio and, with a
    reference, mean k3 KL to `sink`."""

    def loss_fn(model, batch: tuple) -> tuple[torch.Tensor, int]:
        inputs, targets, advantages, *scored = batch
        old_logp = scored.pop(0) if cfg.epochs > 1 else None
        ref_logp = scored.pop(0) if cfg.beta > 0 else None
        logp = token_logprobs(model(inputs), targets, temperature=cfg.temperature)  # as the rollouts were sampled
        loss, stats = grpo_loss(
            logp,
            old_logp,
            advantages,
            targets != IGNORE,
            eps=cfg.clip_eps,
            beta=cfg.beta,
            ref_logp=ref_logp,
            loss_type=cfg.loss_type,
        )
        if sink is not None:
            sink.append(torch.stack([stats[key] for key in loss_stat_keys(cfg)]).float())
        return loss, inputs.shape[0]

    return loss_fn


def loss_stat_keys(cfg: GRPOConfig) -> tuple[str, ...]:
    return ("clip_region", "ratio", "kl") if cfg.beta > 0 else ("clip_region", "ratio")


class OptimisationStats:
    """Per rollout batch: the mean reward of its rollouts and the mean clip fraction, ratio and KL of
    the loss calls on it, logged as one `kind = "grpo"` metrics record; means over the run for
    stats.json."""

    def __init__(self, cfg: GRPOConfig):
        names = {"clip_region": "clip_fraction", "ratio": "ratio", "kl": "kl"}
        self.names = [names[key] for key in loss_stat_keys(cfg)]
        self.sink: list[torch.Tensor] = []  # filled by the loss function
        self.rewards: list[torch.Tensor] = []  # filled by the rollouts
        self.controls: list[dict] = []  # the reward controls' statistics of each rollout
        self.totals, self.calls = torch.zeros(len(self.names), dtype=torch.float64), 0

    def flush(self, trainer) -> None:
        if not self.sink:
            return
        stats = torch.stack(self.sink).double().cpu()
        self.totals += stats.sum(0)
        self.calls += len(stats)
        record = {"kind": "grpo", "step": trainer.step, "reward": torch.cat(self.rewards).float().mean().item()}
        record.update(zip(self.names, stats.mean(0).tolist()))
        for key in self.controls[0] if self.controls else ():
            record[key] = sum(c[key] for c in self.controls) / len(self.controls)
        self.sink.clear()
        self.rewards.clear()
        self.controls.clear()
        if trainer.metrics:
            trainer.metrics.log(record)

    def means(self) -> dict:
        """Each statistic's mean over every loss call of the run."""
        if not self.calls:
            return {}
        return {f"mean_{name}": value for name, value in zip(self.names, (self.totals / self.calls).tolist())}


class GRPO(Stage):
    name = "grpo"

    def sources(self) -> tuple[OnlineSource, OnlineSource]:
        self.prompts = rl_prompts(self.recipe)
        if self.cfg.reward_model:
            model = load_scalar_model(self.cfg.reward_model, key="grpo.reward_model")
            self.shaped = ShapedReward(self.cfg, self.tokenizer, "grpo.reward_model", model=model, out=self.out)
        else:
            self.shaped = ShapedReward(
                self.cfg, self.tokenizer, "grpo.reward_model", base=verifier_reward(self.tokenizer)
            )
        # KL to the starting weights: the frozen copy is held only when the loss uses it.
        self.reference = self.reference_model() if self.cfg.beta > 0 else None
        self.rollout_stats = {"rollouts": 0, "reward_sum": 0.0}
        self.optimisation = OptimisationStats(self.cfg)
        val = reference_answer_batches(self.tokenizer, self.heldout[:64], self.cfg.train.seq_len)
        source = OnlineSource(
            self.rollout,
            seed=self.recipe.train.seed,
            val_batches=val,
            vocab_size=self.tokenizer.vocab_size,
            steps_per_batch=self.cfg.epochs,
        )
        return source, source

    def start(self, trainer) -> None:
        if self.reference is not None:
            self.reference.to(trainer.device)
        if self.shaped.model is not None:
            if self.cfg.rm_refresh_every and trainer.world_size > 1:
                raise ConfigError("grpo.rm_refresh_every", "refreshes the reward model in one process; run on one rank")
            self.shaped.model.to(trainer.device)
        self.shaped.start(trainer.resumed_from is not None)

    def rollout(self, trainer, index: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Sample group_size completions for prompts_per_step prompts from the trainer's policy and
        score them. The batch: tokens, targets (completion only), each sequence's group-normalised
        advantage, then the sampling policy's token log-probs when epochs > 1 and the reference's
        when beta > 0."""
        cfg, tokenizer = self.cfg, self.tokenizer
        self.optimisation.flush(trainer)  # the previous rollout batch's steps are done
        rng = random.Random(seed)
        picked = [self.prompts[rng.randrange(len(self.prompts))] for _ in range(cfg.prompts_per_step)]
        prompt_ids = [render_prompt(tokenizer, [{"role": "user", "content": ex["prompt"]}]) for ex in picked]
        expanded = [p for p in prompt_ids for _ in range(cfg.group_size)]
        examples = [picked[i // cfg.group_size] for i in range(len(expanded))]
        model = trainer.model
        was_training = model.training
        model.eval()
        completions = complete(model, tokenizer, expanded, cfg.max_new_tokens, temperature=cfg.temperature, seed=seed)
        model.train(was_training)
        self.shaped.begin(index)
        rewards = self.rewards(examples, expanded, completions)
        self.optimisation.controls.append(dict(self.shaped.stats))
        refresh = self.shaped.end(index)
        if refresh is not None and trainer.metrics:
            trainer.metrics.log({"kind": "rm_refresh", "step": trainer.step, **refresh})
        self.rollout_stats["rollouts"] += len(completions)
        self.rollout_stats["reward_sum"] += float(rewards.sum())
        self.optimisation.rewards.append(rewards)
        advantages = group_advantages(rewards, cfg.group_size)
        seq_len, pad_id = cfg.train.seq_len, tokenizer.token_id("<|pad|>")
        inputs, targets = [], []
        for p, c in zip(expanded, completions):
            ids = (p + c)[: seq_len + 1]  # c ends with <|end|> when the policy stopped by itself
            target = [IGNORE if i < len(p) - 1 else t for i, t in enumerate(ids[1:])]
            inputs.append(pad(ids[:-1], seq_len, pad_id))
            targets.append(pad(target, seq_len, IGNORE))
        batch = (torch.tensor(inputs), torch.tensor(targets), advantages.float())
        scored = [model] if cfg.epochs > 1 else []
        scored += [self.reference] if self.reference is not None else []
        precision = trainer.cfg.precision
        return batch + tuple(rollout_logprobs(m, *batch[:2], cfg.temperature, precision) for m in scored)

    def rewards(self, examples: list[dict], prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """The reward model's scores when one is set (its heads aggregated), else the task graders'
        0/1; minus the length penalty when set (kiln.post.reward_controls)."""
        return self.shaped(examples, prompts, completions).float()

    def loss_fn(self):
        return make_grpo_loss(self.cfg, self.optimisation.sink)

    def eval_loss_fn(self):
        return sft_loss  # validation: the SFT loss of the held-out reference answers

    def after_fit(self, trainer) -> None:
        self.optimisation.flush(trainer)  # the last rollout batch's steps

    def results(self, trainer, summary: dict, before: dict | None) -> dict:
        rollout = {**self.rollout_stats, **self.optimisation.means()}
        extra = {"rm_refreshes": self.shaped.refreshes} if self.cfg.rm_refresh_every else {}
        return {"rollout": rollout, **extra, **super().results(trainer, summary, before)}
