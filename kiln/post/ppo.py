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

The actor trains through the spine's Trainer. The critic is attached to the actor model as the
submodule `critic` (`prepare_model`), so one optimizer updates both, every checkpoint holds both and
resume restores both; the stage then writes the actor alone, LoRA merged, to `<out>/policy`, a
plain weights checkpoint for sampling, export or the next stage (a training checkpoint of this
stage has the extra `critic.*` tensors and does not load as a plain Transformer). Batches come from
an OnlineSource whose batch index says which cycle, epoch and minibatch to serve; checkpoints fall
on cycle boundaries (checked), so a resumed run regenerates exactly the rollouts it would have had.
"""

from __future__ import annotations

import functools
import random
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from kiln.errors import ConfigError
from kiln.post.config import PPOConfig

if TYPE_CHECKING:
    import torch

IGNORE = -100
POLICY_DIR = "policy"

# reward_fn(examples, prompt ids, completion ids) -> one score per completion
RewardFn = Callable[[list[dict], list[list[int]], list[list[int]]], "list[float] | torch.Tensor"]


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


def _no_grad(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return run


def autocast_for(precision: str, device: torch.device):
    """The training loop's autocast, so rollout log-probs are computed as the loss computes them."""
    import torch

    from kiln.train.trainer import PRECISION_DTYPES

    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=PRECISION_DTYPES[precision])


def critic_of(model) -> torch.nn.Module:
    return getattr(model, "module", model).critic


@_no_grad
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
    import torch

    from kiln.infer.engine import Engine
    from kiln.post.losses import gae, kl_estimate, masked_mean, token_logprobs, whiten

    stop = (tokenizer.token_id("<|end|>"), tokenizer.eot_id)
    outs = Engine(actor).generate(
        prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, stop_token_ids=stop, seed=seed
    )
    completions = [list(o.ids) for o in outs]
    pad = tokenizer.token_id("<|pad|>")
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
    mask = targets != IGNORE

    device = next(actor.parameters()).device
    x, y = inputs.to(device), targets.to(device)
    models = (actor, reference, critic)
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        with autocast_for(precision, device):
            logp = token_logprobs(actor(x), y, cfg.temperature).cpu()
            ref_logp = token_logprobs(reference(x), y, cfg.temperature).cpu()
            values = critic(x)[..., 0].float().cpu()
    finally:
        for m, was in zip(models, modes):
            m.train(was)

    scores = torch.as_tensor(reward_fn(examples, prompts, completions), dtype=torch.float32).reshape(n)
    stopped = torch.tensor([bool(c) and c[-1] in stop for c in completions])
    scores = scores - cfg.missing_stop_penalty * (~stopped).float()
    kl = kl_estimate(logp, ref_logp, cfg.kl_estimator, mask)
    rewards = -cfg.kl_coef * kl
    rows = torch.arange(n)
    rewards[rows, torch.tensor(last)] += scores
    values = torch.where(mask, values, torch.zeros(()))
    advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = whiten(advantages, mask)
    lengths = mask.sum(-1).float()
    stats = {
        "score": scores.mean().item(),
        "kl": (kl.sum(-1)).mean().item(),
        "kl_per_token": masked_mean(kl, mask).item(),
        "length": lengths.mean().item(),
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
    import torch

    from kiln.post.losses import masked_mean, ppo_policy_loss, ppo_value_loss, token_entropy, token_logprobs

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


# ---- models and rewards ----------------------------------------------------------------------------


def _resolve(recipe, value: str, key: str) -> Path:
    if value == "rm":
        from kiln.pipeline import stage_dir

        path = stage_dir(recipe, "rm")
        if not path.exists():
            raise ConfigError(
                key,
                f"'rm' names this run's rm stage, but {path} does not exist (add rm to "
                f"run.stages before ppo, or give a reward-model checkpoint path)",
            )
        return path
    return Path(value)


def build_critic(recipe, cfg: PPOConfig, init: Path) -> torch.nn.Module:
    from kiln.model.weights import load_model
    from kiln.post.rm import attach_scalar_head, load_scalar_model

    if cfg.critic_init == "policy":
        critic, _ = load_model(init)
        attach_scalar_head(critic)
        return critic.train()
    return load_scalar_model(_resolve(recipe, cfg.critic_init, "ppo.critic_init"), "ppo.critic_init").train()


def verifier_reward(tokenizer) -> RewardFn:
    from kiln.post.stages import strip_stop
    from kiln.post.tasks import grade

    def reward(examples, prompts, completions):
        return [grade(ex, tokenizer.decode(strip_stop(tokenizer, c))) for ex, c in zip(examples, completions)]

    return reward


def model_reward(model, tokenizer, batch_size: int = 32) -> RewardFn:
    """Scores from a reward model: its value at the last token of prompt + completion."""
    import torch

    from kiln.post.rm import sequence_scores

    pad = tokenizer.token_id("<|pad|>")

    @_no_grad
    def reward(examples, prompts, completions):
        device = next(model.parameters()).device
        seqs = [p + c for p, c in zip(prompts, completions)]
        scores = []
        for start in range(0, len(seqs), batch_size):
            chunk = seqs[start : start + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk], device=device)
            last = torch.tensor([len(s) - 1 for s in chunk], device=device)
            scores.append(sequence_scores(model, ids, last).cpu())
        return torch.cat(scores)

    return reward


def _prompts(recipe, cfg: PPOConfig, tokenizer, out: Path) -> tuple[list[dict], list[list[int]]]:
    from kiln.data.chat import render_prompt
    from kiln.post import stages as S

    if cfg.files:
        from kiln.post.data import read_prompts

        examples, _ = read_prompts(cfg.files, rejected_path=out / "rejected.jsonl")
        if cfg.reward == "verifier" and any(ex.get("answer") is None for ex in examples):
            raise ConfigError(
                "ppo.reward",
                "the verifier grades against each prompt's answer; some prompts in "
                "ppo.files have none (give answers or use a reward model)",
            )
        return examples, [render_prompt(tokenizer, ex["messages"]) for ex in examples]
    examples = S.train_tasks(recipe.tasks)
    return examples, [render_prompt(tokenizer, [{"role": "user", "content": ex["prompt"]}]) for ex in examples]


# ---- the stage -------------------------------------------------------------------------------------


class _Cycles:
    """Serves the minibatches of one rollout cycle after another from the OnlineSource's batch
    index, and logs each cycle's rollout and optimisation statistics."""

    def __init__(self, recipe, cfg: PPOConfig, tokenizer, examples, prompts, reward_fn, reference, sink):
        self.recipe, self.cfg, self.tokenizer = recipe, cfg, tokenizer
        self.examples, self.prompts, self.reward_fn = examples, prompts, reward_fn
        self.reference, self.sink = reference, sink
        self.trainer = self.source = None
        self.cycle, self.buffer, self.history = None, None, []

    def __call__(self, _seed: int) -> tuple[torch.Tensor, ...]:
        import torch

        trainer, cfg = self.trainer, self.cfg
        micro, accum = trainer.cfg.micro_batch_size, trainer.accum_steps
        per_epoch = cfg.minibatches * accum  # micro-batches in one pass over the buffer
        cycle, position = divmod(self.source.batches, cfg.ppo_epochs * per_epoch)
        if cycle != self.cycle:
            self.flush()
            self.buffer = self._rollout(cycle, micro * per_epoch)
            self.cycle = cycle
        epoch, index = divmod(position, per_epoch)
        g = torch.Generator().manual_seed(self._seed(cycle) + epoch)
        rows = torch.randperm(self.buffer[0].shape[0], generator=g)[index * micro : (index + 1) * micro]
        return tuple(t[rows] for t in self.buffer)

    def _seed(self, cycle: int) -> int:
        return (self.recipe.train.seed * 1_000_003 + cycle) * 4099

    def _rollout(self, cycle: int, n: int) -> tuple[torch.Tensor, ...]:
        rng = random.Random(f"kiln-ppo|{self.recipe.train.seed}|{cycle}")
        total = len(self.prompts)
        picked = rng.sample(range(total), n) if n <= total else [rng.randrange(total) for _ in range(n)]
        model = self.trainer.model
        rollout = make_rollout(
            model,
            critic_of(model),
            self.reference,
            self.tokenizer,
            [self.examples[i] for i in picked],
            [self.prompts[i] for i in picked],
            self.reward_fn,
            self.cfg,
            self.trainer.cfg.seq_len,
            self._seed(cycle),
            self.trainer.cfg.precision,
        )
        record = {"kind": "rollout", "step": self.trainer.step, "cycle": cycle, **rollout.stats}
        self.history.append(record)
        if self.trainer.metrics:
            self.trainer.metrics.log(record)
        return rollout.training_tensors()

    def flush(self, after_fit: bool = False) -> None:
        """Log the mean optimisation statistics of the cycle that just ended."""
        if not self.sink:
            return
        import torch

        means = torch.stack(self.sink).mean(0).tolist()
        self.sink.clear()
        record = {"kind": "ppo", "step": self.trainer.step, "cycle": self.cycle, **dict(zip(LOSS_STATS, means))}
        if self.history and self.history[-1].get("cycle") == self.cycle:
            self.history[-1].update({k: v for k, v in record.items() if k not in ("kind", "step")})
        if self.trainer.is_main and after_fit:  # fit() has closed its logger: append to the same file
            from kiln.train.metrics import MetricsLogger

            logger = MetricsLogger(self.trainer.out_dir)
            logger.log(record)
            logger.close()
        elif self.trainer.metrics:
            self.trainer.metrics.log(record)


def run_ppo(recipe, out: Path, init: Path, tokenizer, resume: str = "auto", reward_fn: RewardFn | None = None) -> dict:
    """reward_fn overrides the configured reward (e.g. a custom verifier)."""
    import torch

    from kiln.model.weights import load_model
    from kiln.post import stages as S
    from kiln.post.rm import load_scalar_model
    from kiln.post.run import _baseline, _peft, _trainer
    from kiln.post.sources import OnlineSource

    cfg = recipe.ppo
    try:
        cfg.validate()
    except ConfigError as err:
        raise err.within("ppo") from None
    out = Path(out)
    examples, prompts = _prompts(recipe, cfg, tokenizer, out)
    longest = max(map(len, prompts))
    if longest + cfg.max_new_tokens > cfg.train.seq_len + 1:
        raise ConfigError(
            "ppo.train.seq_len",
            f"the longest prompt ({longest} tokens) + max_new_tokens ({cfg.max_new_tokens}) must fit in seq_len + 1",
        )
    reward_name, reward_model = ("custom" if reward_fn is not None else cfg.reward), None
    if reward_fn is None:
        if cfg.reward == "verifier":
            reward_fn = verifier_reward(tokenizer)
        else:
            reward_model = load_scalar_model(_resolve(recipe, cfg.reward, "ppo.reward"), "ppo.reward")
            if reward_model.cfg.vocab_size < tokenizer.vocab_size:
                raise ConfigError(
                    "ppo.reward",
                    f"reward model vocabulary {reward_model.cfg.vocab_size} < the "
                    f"tokenizer's {tokenizer.vocab_size} (same tokenizer needed)",
                )
            reward_fn = model_reward(reward_model, tokenizer)
    heldout = S.heldout_tasks(recipe.tasks)
    before = _baseline(init, tokenizer, heldout)
    reference, _ = load_model(init)
    reference.requires_grad_(False)
    peft = _peft(recipe)

    def prepare(model):
        if peft is not None:
            peft(model)  # the actor only: the critic, attached after, trains fully
        critic = build_critic(recipe, cfg, init).to(next(model.parameters()).device)
        if critic.cfg.vocab_size < tokenizer.vocab_size:
            raise ConfigError(
                "ppo.critic_init",
                f"critic vocabulary {critic.cfg.vocab_size} < the tokenizer's "
                f"{tokenizer.vocab_size} (same tokenizer needed)",
            )
        model.add_module("critic", critic)

    sink: list = []
    cycles = _Cycles(recipe, cfg, tokenizer, examples, prompts, reward_fn, reference, sink)
    sampled = heldout[:: max(1, len(heldout) // 64)][:64]  # spread over the families, which come in blocks
    val_rows, _ = S.sft_rows(
        tokenizer,
        [[{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": ex["answer"]}] for ex in sampled],
        cfg.train.seq_len,
        packing=False,
    )
    val_batches = [tuple(torch.stack(p) for p in zip(*val_rows[i : i + 16])) for i in range(0, len(val_rows), 16)]
    source = OnlineSource(cycles, seed=recipe.train.seed, val_batches=val_batches, vocab_size=tokenizer.vocab_size)
    # Validation: the SFT loss of the held-out reference answers, a policy-only measure.
    trainer = _trainer(
        recipe,
        out,
        cfg,
        (source, source),
        make_ppo_loss(cfg, sink),
        init,
        resume,
        prepare_model=prepare,
        eval_loss_fn=S.sft_loss,
    )
    if trainer.world_size > 1:
        raise ConfigError("parallel", "ppo runs in one process: rollouts sample from the whole actor")
    reference.to(trainer.device)
    if reward_model is not None:
        reward_model.to(trainer.device)
    cycles.trainer, cycles.source = trainer, source
    summary = trainer.fit()
    cycles.flush(after_fit=True)
    after = S.task_accuracy(trainer.model, tokenizer, heldout)
    stats = {
        "train": summary,
        "rollouts": cycles.history,
        "heldout_before": before,
        "heldout_after": after,
        "reward": reward_name,
    }
    if trainer.is_main:
        stats["policy"] = str(
            export_policy(
                trainer.model,
                trainer.model_cfg,
                out / POLICY_DIR,
                {"stage": "ppo", "checkpoint": summary["checkpoint"]},
            )
        )
        peft_cfg = getattr(recipe, "peft", None)
        if peft_cfg is not None and peft_cfg.method != "none":
            stats["peft"] = export_adapter(trainer.model, trainer.model_cfg, peft_cfg, out / "adapter")
        S.write_stats(out, stats)
        line = f"[{out.name}] held-out task accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
        if cycles.history:
            first, final = cycles.history[0], cycles.history[-1]
            line += (
                f"; rollout score {first['score']:.3f} -> {final['score']:.3f}, "
                f"KL {first['kl']:.2e} -> {final['kl']:.2e}"
            )
        print(line)
    return stats


def export_adapter(model, model_cfg, peft_cfg, folder: Path) -> dict:
    """The actor's small trainable weights: PEFT format for LoRA/QLoRA, Kiln's own for adapters.
    The critic holds no PEFT layers, so neither writer sees it."""
    from kiln.peft.peft_io import save_peft_adapter, save_trainable

    if peft_cfg.method in ("lora", "qlora"):
        save_peft_adapter(model, model_cfg, folder, peft_cfg)
    else:
        save_trainable(model, peft_cfg, folder)
    return {"method": peft_cfg.method, "adapter": str(folder)}


def export_policy(model, model_cfg, folder: Path, extra: dict) -> Path:
    """The actor alone (no `critic.*`), LoRA merged: a plain checkpoint `load_model` reads."""
    from kiln.checkpoint import save_weights
    from kiln.peft.peft_io import merged_state_dict

    try:
        state = merged_state_dict(model)
    except ValueError:
        # Bottleneck adapters cannot be folded in: the export keeps them (load with adapters applied).
        state = model.state_dict()
    state = {k: v for k, v in state.items() if not k.startswith("critic.")}
    return save_weights(folder, model_cfg, state, extra)
