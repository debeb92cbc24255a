"""Reward-hacking controls of PPO and GRPO, beyond the KL to the reference (docs/post_rl.md, "Reward
hacking"): the reward a rollout batch trains on is built here from the configured reward.

- **Ensemble aggregation.** A reward model with several scalar heads (`rm.heads`) gives [N, heads]
  scores; `reward_ensemble` reduces them: `mean`, `min` (Coste et al. 2023's worst-case optimisation,
  WCO) or `mean_minus_std` (their uncertainty-weighted optimisation, UWO, with the standard deviation
  over the heads in place of the variance, so lambda = `uncertainty_penalty` is in reward units). The
  heads' disagreement (that standard deviation) is logged per rollout batch.
- **Length control.** `length_penalty` alpha per completion token beyond `length_target` (the stop
  token not counted): reward - alpha * max(0, L - target), for any reward, verifier included.
- **Refresh.** Every `rm_refresh_every` rollout batches the reward model is fine-tuned for
  `rm_refresh_steps` AdamW steps on that batch's fresh policy samples labelled by the gold signal,
  the task verifier: each sample the verifier rejects becomes a pair (the prompt's answer chosen,
  the sample rejected). Each refresh writes the reward model's weights to `<out>/rm_refresh/`, and a
  resumed run restores the last one taken before the batch it resumes at.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import torch

from kiln.checkpoint import read_safetensors, write_safetensors
from kiln.errors import ConfigError
from kiln.post.config import RewardControls
from kiln.post.evaluate import strip_stop
from kiln.post.rm import model_reward, pair_loss, preference_accuracy
from kiln.post.tasks import grade

# reward_fn(examples, prompt ids, completion ids) -> one score per completion
RewardFn = Callable[[list[dict], list[list[int]], list[list[int]]], "list[float] | torch.Tensor"]
REFRESH_DIR = "rm_refresh"


def aggregate_heads(scores: torch.Tensor, mode: str, penalty: float = 0.0) -> torch.Tensor:
    """[N, heads] scores -> [N] rewards by `mode` (mean | min | mean_minus_std, lambda = penalty)."""
    if mode == "mean":
        return scores.mean(-1)
    if mode == "min":
        return scores.min(-1).values
    if mode == "mean_minus_std":
        return scores.mean(-1) - penalty * head_disagreement(scores)
    raise ValueError(f"unknown reward ensemble {mode!r}")


def head_disagreement(scores: torch.Tensor) -> torch.Tensor:
    """[N, heads] -> [N]: the standard deviation over the heads (population: 0 for one head)."""
    return scores.std(-1, correction=0)


def completion_lengths(tokenizer, completions: list[list[int]]) -> torch.Tensor:
    """Tokens of each completion, a final stop token not counted."""
    return torch.tensor([len(strip_stop(tokenizer, c)) for c in completions], dtype=torch.float32)


def length_penalties(lengths: torch.Tensor, alpha: float, target: int) -> torch.Tensor:
    """alpha per token beyond target: alpha * max(0, L - target)."""
    return alpha * (lengths - target).clamp_min(0)


def verifier_reward(tokenizer) -> RewardFn:
    """The task graders' 0/1 on each decoded completion (its stop token removed)."""

    def reward(examples, prompts, completions):
        return [grade(ex, tokenizer.decode(strip_stop(tokenizer, c))) for ex, c in zip(examples, completions)]

    return reward


def gold_pairs(tokenizer, examples, prompts, completions) -> list[tuple[torch.Tensor, ...]]:
    """(answer ids, last, sample ids, last) for each sample the verifier rejects: the prompt followed
    by its reference answer and `<|end|>` is chosen over the prompt followed by the sample. Rows are
    right-padded to the longest sequence of the batch."""
    end, pad = tokenizer.token_id("<|end|>"), tokenizer.token_id("<|pad|>")
    seqs = []
    for ex, p, c in zip(examples, prompts, completions):
        if grade(ex, tokenizer.decode(strip_stop(tokenizer, c))) == 0.0:
            seqs.append((p + tokenizer.encode(str(ex["answer"]), parse_special=False) + [end], p + c))
    width = max((len(s) for pair in seqs for s in pair), default=0)
    rows = []
    for pair in seqs:
        row = []
        for s in pair:
            row += [torch.tensor(s + [pad] * (width - len(s))), torch.tensor(len(s) - 1)]
        rows.append(tuple(row))
    return rows


def refresh_reward_model(model, rows: list[tuple], steps: int, lr: float) -> dict:
    """`steps` full-batch AdamW steps of the Bradley-Terry loss (every head) on `rows`; the model is
    left in eval mode. Returns the loss and pairwise accuracy on the rows before and after."""
    device = next(model.parameters()).device
    batch = tuple(torch.stack(parts).to(device) for parts in zip(*rows))
    before = preference_accuracy(model, rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    with torch.no_grad():
        loss_before = pair_loss(model, batch).item()
    for _ in range(steps):
        loss = pair_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        loss_after = pair_loss(model, batch).item()
    after = preference_accuracy(model, rows)
    return {
        "pairs": len(rows),
        "loss_before": loss_before,
        "loss_after": loss_after,
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
    }


class ShapedReward:
    """The reward of a rollout batch: `base` (a reward function -> [N]) or the reward `model`
    (-> [N, heads], aggregated by cfg.reward_ensemble), minus the length penalty. After each call
    `stats` holds the batch's means: the raw reward, the heads' disagreement (several heads), the
    completion length and its penalty (length control on). `key` names the stage's reward setting
    in errors; `out` is the stage folder (refresh snapshots)."""

    def __init__(self, cfg: RewardControls, tokenizer, key: str, base: RewardFn | None = None, model=None, out=None):
        if (base is None) == (model is None):
            raise ValueError("give a reward function or a reward model, not both")
        self.cfg, self.tokenizer, self.key, self.base, self.model = cfg, tokenizer, key, base, model
        self.heads = 0 if model is None else model.output.weight.shape[0]
        stage = key.split(".")[0]
        if model is not None and self.heads == 1 and cfg.reward_ensemble != "mean":
            raise ConfigError(
                f"{stage}.reward_ensemble",
                f"{cfg.reward_ensemble} needs a multi-head reward model (rm.heads > 1); {key} has one head",
            )
        for name in ("reward_ensemble", "rm_refresh_every"):
            if model is None and getattr(cfg, name) != getattr(RewardControls(), name):
                raise ConfigError(f"{stage}.{name}", f"acts on a learned reward model; {key} is not one")
        self.score_heads = model_reward(model, tokenizer, heads=True) if model is not None else None
        self.snapshots = Path(out) / REFRESH_DIR if out is not None else None
        self.stats: dict = {}
        self.batch = None
        self.refreshes: list[dict] = []
        self.pending_restore = False

    def __call__(self, examples, prompts, completions) -> torch.Tensor:
        cfg, stats = self.cfg, {}
        if self.model is not None:
            scores = self.score_heads(examples, prompts, completions)
            reward = aggregate_heads(scores, cfg.reward_ensemble, cfg.uncertainty_penalty)
            stats["raw_reward"] = scores.mean().item()
            if self.heads > 1:
                spread = head_disagreement(scores)
                stats["rm_std"], stats["rm_std_max"] = spread.mean().item(), spread.max().item()
        else:
            reward = torch.as_tensor(self.base(examples, prompts, completions), dtype=torch.float32)
            stats["raw_reward"] = reward.mean().item()
        if cfg.length_penalty:
            lengths = completion_lengths(self.tokenizer, completions)
            penalty = length_penalties(lengths, cfg.length_penalty, cfg.length_target)
            reward = reward - penalty
            stats["length_tokens"], stats["length_penalty"] = lengths.mean().item(), penalty.mean().item()
        self.stats, self.batch = stats, (examples, prompts, completions)
        return reward

    # ---- refresh ----------------------------------------------------------------------------------

    def check_gold(self, examples: list[dict]) -> None:
        """Refresh labels samples with the verifier: every prompt needs its answer."""
        if self.cfg.rm_refresh_every and any(ex.get("answer") is None for ex in examples):
            raise ConfigError(
                f"{self.key.split('.')[0]}.rm_refresh_every",
                "labels fresh samples with the task verifier, which needs each prompt's answer; some prompts have none",
            )

    def start(self, resumed: bool) -> None:
        """A fresh run drops the snapshots of an earlier one; a resumed run restores at its first batch."""
        if self.snapshots is None or not self.cfg.rm_refresh_every:
            return
        if resumed:
            self.pending_restore = True
        elif self.snapshots.exists():
            shutil.rmtree(self.snapshots)

    def begin(self, index: int) -> None:
        """Before rollout batch `index`: a resumed run loads the last refresh taken before it."""
        if not self.pending_restore:
            return
        self.pending_restore = False
        taken = sorted(int(p.stem.split("_")[1]) for p in self.snapshots.glob("batch_*.safetensors"))
        earlier = [i for i in taken if i < index]
        if earlier:
            state = read_safetensors(self.snapshots / f"batch_{earlier[-1]:08d}.safetensors")
            self.model.load_state_dict(state)

    def end(self, index: int) -> dict | None:
        """After rollout batch `index` was scored: refresh the reward model on it when one is due.
        Returns the refresh's record (None when none was due)."""
        every = self.cfg.rm_refresh_every
        if not every or (index + 1) % every or self.batch is None:
            return None
        rows = gold_pairs(self.tokenizer, *self.batch)
        record = {"batch": index, "pairs": len(rows)}
        if rows:
            record.update(refresh_reward_model(self.model, rows, self.cfg.rm_refresh_steps, self.cfg.rm_refresh_lr))
        if self.snapshots is not None:
            self.snapshots.mkdir(parents=True, exist_ok=True)
            # Cloned: safetensors stores no shared storage (a tied head), and load_state_dict refills both.
            state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
            write_safetensors(state, self.snapshots / f"batch_{index:08d}.safetensors")
        self.refreshes.append(record)
        return record
