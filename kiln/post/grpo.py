"""`kiln grpo`: group-relative policy optimisation on verifiable tasks (see docs/post.md).

Each step samples `prompts_per_step` [tasks] prompts, `group_size` completions each, from the live
policy (the stage's OnlineSource is bound to the Trainer) with the KV-cache engine, seeded by the
step so a resumed run samples the same rollouts. Rewards come from the task graders, or, with
`reward_model` set, from a learned reward model trained by `kiln rm`; advantages are rewards
normalised within each group. One optimisation pass per rollout batch, so the old policy is the
current one (ratio 1); token log-probs use the sampling temperature, as the rollouts did.
Validation: the SFT loss of held-out reference answers. Measured: held-out task accuracy before
and after. [peft] and its outputs as in SFT; the driver (kiln.post.driver) runs these parts on the
shared Trainer.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from kiln.data.chat import render_prompt
from kiln.post.evaluate import complete, strip_stop
from kiln.post.losses import group_advantages, grpo_loss, token_logprobs
from kiln.post.protocol import Stage
from kiln.post.rm import load_scalar_model, model_reward
from kiln.post.rows import IGNORE, pad
from kiln.post.sft import reference_answer_batches, sft_loss
from kiln.post.sources import OnlineSource
from kiln.post.tasks import grade, train_tasks


def rl_prompts(recipe) -> list[dict]:
    """GRPO's prompt pool: [tasks] train-split problems, drawn with grpo.prompt_seed when it is set
    (problems SFT did not see; the split hash keeps them out of the held-out set either way)."""
    seed = recipe.grpo.prompt_seed
    return train_tasks(recipe.tasks if seed is None else dataclasses.replace(recipe.tasks, seed=seed))


class GRPO(Stage):
    name = "grpo"

    def sources(self) -> tuple[OnlineSource, OnlineSource]:
        self.prompts = rl_prompts(self.recipe)
        self.judge = None
        if self.cfg.reward_model:
            judge = load_scalar_model(self.cfg.reward_model, key="grpo.reward_model")
            self.judge = model_reward(judge, self.tokenizer)
        self.rollout_stats = {"rollouts": 0, "reward_sum": 0.0}
        val = reference_answer_batches(self.tokenizer, self.heldout[:64], self.cfg.train.seq_len)
        source = OnlineSource(
            self.rollout, seed=self.recipe.train.seed, val_batches=val, vocab_size=self.tokenizer.vocab_size
        )
        return source, source

    def rollout(self, trainer, index: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Sample group_size completions for prompts_per_step prompts from the trainer's policy and
        score them; the batch carries tokens, targets (completion only) and each sequence's
        group-normalised advantage."""
        cfg, tokenizer = self.cfg, self.tokenizer
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
        rewards = self.rewards(examples, expanded, completions)
        self.rollout_stats["rollouts"] += len(completions)
        self.rollout_stats["reward_sum"] += float(rewards.sum())
        advantages = group_advantages(rewards, cfg.group_size)
        seq_len, pad_id = cfg.train.seq_len, tokenizer.token_id("<|pad|>")
        inputs, targets = [], []
        for p, c in zip(expanded, completions):
            ids = (p + c)[: seq_len + 1]  # c ends with <|end|> when the policy stopped by itself
            target = [IGNORE if i < len(p) - 1 else t for i, t in enumerate(ids[1:])]
            inputs.append(pad(ids[:-1], seq_len, pad_id))
            targets.append(pad(target, seq_len, IGNORE))
        return torch.tensor(inputs), torch.tensor(targets), advantages.float()

    def rewards(self, examples: list[dict], prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """The reward model's scores when one is set, else the task graders' 0/1."""
        if self.judge is not None:
            return torch.as_tensor(self.judge(examples, prompts, completions)).float()
        texts = [self.tokenizer.decode(strip_stop(self.tokenizer, c)) for c in completions]
        return torch.tensor([grade(ex, text) for ex, text in zip(examples, texts)])

    def loss_fn(self):
        cfg = self.cfg

        def loss_fn(model, batch):
            inputs, targets, advantages = batch
            logits = model(inputs)
            logp = token_logprobs(logits, targets, temperature=cfg.temperature)  # as the rollouts were sampled
            mask = targets != IGNORE
            # One optimisation pass per rollout batch: the sampling policy is the current one, so the
            # old log-probs are the current ones detached (ratio 1, the clip inactive but kept general).
            loss, _ = grpo_loss(
                logp, logp.detach(), advantages, mask, eps=cfg.clip_eps, beta=0.0, loss_type=cfg.loss_type
            )
            return loss, inputs.shape[0]

        return loss_fn

    def eval_loss_fn(self):
        return sft_loss  # validation: the SFT loss of the held-out reference answers

    def results(self, trainer, summary: dict, before: dict | None) -> dict:
        return {"rollout": self.rollout_stats, **super().results(trainer, summary, before)}
