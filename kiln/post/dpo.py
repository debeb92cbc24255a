"""`kiln dpo`: direct preference optimisation on (prompt, chosen, rejected) pairs (see docs/post.md).

Pairs come from JSONL files or from the [tasks] train split: a plausible wrong answer rejected
(`rejected = "distractor"`), or the starting model's own wrong greedy answer (`"policy"`). Each
pair is rendered twice with the loss mask on the answer. The reference is the starting model: its
sequence log-probs are computed once, before training, under the training loop's autocast (so at
step 0 the policy's equal them and the margin starts at exactly zero), and stored with the pairs,
so no second model is held while training. Loss: DPO (sigmoid, IPO or cDPO) plus `nll_weight`
times the chosen answers' per-token NLL (RPO). Validation: the DPO loss on held-out task pairs.
Measured: held-out task accuracy before and after, and the implicit-reward accuracy and margin on
held-out pairs (`heldout_preferences`). [peft] and its outputs as in SFT; the driver
(kiln.post.driver) runs these parts on the shared Trainer.
"""

from __future__ import annotations

import random

import torch

from kiln.data.chat import render_conversation, render_prompt
from kiln.post.config import DPOConfig
from kiln.post.data import read_preferences
from kiln.post.evaluate import complete, strip_stop
from kiln.post.losses import dpo_loss, sequence_logprobs
from kiln.post.protocol import Stage
from kiln.post.rows import IGNORE, pad, trimmed
from kiln.post.sources import ExampleSource
from kiln.post.tasks import grade, task_preference_pairs, to_messages
from kiln.train.precision import autocast

# ---- pairs -----------------------------------------------------------------------------------------


def policy_pairs(
    model, tokenizer, tasks: list[dict], wanted: int, seed: int = 0, chunk: int = 256
) -> tuple[list, dict]:
    """On-policy preference pairs: chosen = the task's answer, rejected = the model's own greedy
    answer where the grader marks it wrong. Tasks are visited in a seeded order until `wanted` pairs
    exist (one pass of training), so the cost is bounded by what the stage will use. Problems the
    model already solves give no pair; if it solves every one, the distractor pairs stand in."""
    order = list(range(len(tasks)))
    random.Random(f"kiln-policy-pairs|{seed}").shuffle(order)
    pairs, asked = [], 0
    for start in range(0, len(order), chunk):
        batch = [tasks[i] for i in order[start : start + chunk]]
        prompts = [render_prompt(tokenizer, to_messages(ex, with_answer=False)) for ex in batch]
        completions = complete(model, tokenizer, prompts, max_new_tokens=16)
        asked += len(batch)
        for ex, ids in zip(batch, completions):
            text = tokenizer.decode(strip_stop(tokenizer, ids)).strip()
            if text and grade(ex, text) == 0.0:
                pairs.append((to_messages(ex, with_answer=False), ex["answer"], text))
        if len(pairs) >= wanted:
            break
    stats = {"rejected": "policy", "prompts_tried": asked, "policy_wrong": len(pairs)}
    if not pairs:
        print("[dpo] the starting model answers every task prompt tried correctly: using distractor pairs")
        return task_preference_pairs(tasks, seed=seed), {**stats, "rejected": "distractor"}
    return pairs, stats


def pair_rows(
    tokenizer, pairs: list[tuple[list[dict], str, str]], seq_len: int, rejected_to_divergence: bool = False
) -> list[tuple]:
    """(chosen ids, chosen targets, rejected ids, rejected targets) with loss on the answers only.

    `rejected_to_divergence` scores the rejected answer only up to its first token that differs
    from the chosen one. A near miss ("sun cat dog" for "sun dog cat") is wrong at that token; the
    tokens after it continue a wrong prefix and are often right in themselves, and pushing them down
    unlearns the skill the chosen answer uses (measured: held-out accuracy fell). The shared prefix
    scores the same in both sequences, so it cancels in the margin."""
    pad_id = tokenizer.token_id("<|pad|>")
    rows = []
    for prompt, chosen, rejected in pairs:
        row, rendered = [], []
        for answer in (chosen, rejected):
            ids, mask = render_conversation(tokenizer, [*prompt, {"role": "assistant", "content": answer}])
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
            rendered.append(ids)
            targets = [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])]
            if rejected_to_divergence and len(rendered) == 2:
                first = next((i for i, (a, b) in enumerate(zip(*rendered)) if a != b), min(map(len, rendered)))
                # targets[j] predicts ids[j + 1]: keep up to the prediction of the first differing id.
                targets = [t if j < first else IGNORE for j, t in enumerate(targets)]
            row += [torch.tensor(pad(ids[:-1], seq_len, pad_id)), torch.tensor(pad(targets, seq_len, IGNORE))]
        rows.append(tuple(row))
    return rows


def pair_logprobs(model, chosen, chosen_targets, rejected, rejected_targets):
    """Sequence log-probs of the chosen and the rejected answers, in one forward pass."""
    targets, inputs = trimmed(torch.cat([chosen_targets, rejected_targets]), torch.cat([chosen, rejected]))
    logits = model(inputs)
    mask = targets != IGNORE
    logps = sequence_logprobs(logits, targets, mask)
    return logps.chunk(2)


@torch.no_grad()
def reference_logprobs(model, rows: list[tuple], batch_size: int = 32, precision: str = "fp32") -> list[tuple]:
    """Append the frozen reference model's sequence log-probs of chosen and rejected to each row:
    computed once before training, so DPO needs no second model in memory while it trains.
    `precision` is the training loop's, so the reference runs under the policy's autocast."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        parts = [torch.stack(p).to(device) for p in zip(*chunk)]
        with autocast(precision, device):
            ref_c, ref_r = pair_logprobs(model, *parts)
        ref_c, ref_r = ref_c.cpu(), ref_r.cpu()
        out += [(*row, c, r) for row, c, r in zip(chunk, ref_c.float(), ref_r.float())]
    model.train(was_training)
    return out


# ---- the objective and the held-out preferences ----------------------------------------------------


def make_dpo_loss(cfg: DPOConfig):
    """DPO (sigmoid, IPO or cDPO) on pre-computed reference log-probs, plus `nll_weight` times the
    per-token NLL of the chosen answers (RPO; OpenRLHF's nll_loss_coef). The NLL term keeps the
    likelihood of the correct answer from falling while the margin grows: without it, DPO on small,
    low-diversity pairs lowers both answers' likelihood and greedy accuracy with them."""
    loss_type = "sigmoid" if cfg.loss_type == "cdpo" else cfg.loss_type
    smoothing = cfg.label_smoothing if cfg.loss_type == "cdpo" else 0.0

    def loss_fn(model, batch: tuple) -> tuple[torch.Tensor, int]:
        chosen, chosen_t, rejected, rejected_t, ref_chosen, ref_rejected = batch
        pol_chosen, pol_rejected = pair_logprobs(model, chosen, chosen_t, rejected, rejected_t)
        chosen_lengths = (chosen_t != IGNORE).sum(-1)
        # IPO's target margin is per token (TRL's normalisation), so it needs the answer lengths.
        loss, _, _ = dpo_loss(
            pol_chosen,
            pol_rejected,
            ref_chosen,
            ref_rejected,
            beta=cfg.beta,
            loss_type=loss_type,
            label_smoothing=smoothing,
            chosen_lengths=chosen_lengths,
            rejected_lengths=(rejected_t != IGNORE).sum(-1),
        )
        if cfg.nll_weight:
            loss = loss - cfg.nll_weight * pol_chosen.sum() / chosen_lengths.sum().clamp(min=1)
        return loss, chosen.shape[0]

    return loss_fn


@torch.no_grad()
def preference_stats(model, rows: list[tuple], beta: float, precision: str = "fp32") -> dict:
    """Implicit-reward accuracy and margin on held-out pairs: reward = beta * (policy - reference)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, margins = 0, []
    for start in range(0, len(rows), 32):
        parts = [torch.stack(p) for p in zip(*rows[start : start + 32])]
        with autocast(precision, device):
            pol_c, pol_r = (x.cpu() for x in pair_logprobs(model, *(p.to(device) for p in parts[:4])))
        margin = beta * ((pol_c - parts[4]) - (pol_r - parts[5]))
        correct += int((margin > 0).sum())
        margins += margin.tolist()
    model.train(was_training)
    return {"reward_accuracy": correct / len(margins), "mean_reward_margin": sum(margins) / len(margins)}


# ---- the stage -------------------------------------------------------------------------------------


class DPO(Stage):
    name = "dpo"

    def sources(self) -> tuple[ExampleSource, ExampleSource]:
        cfg, precision, seed = self.cfg, self.recipe.train.precision, self.recipe.tasks.seed
        reference = self.reference_model()  # the starting policy, frozen for its log-probs
        self.pair_stats = {}
        if cfg.files:
            pairs, _ = read_preferences(cfg.files)
        elif cfg.rejected == "policy":
            train_cfg = cfg.train.train_config(self.recipe.train)
            wanted = train_cfg.max_steps * (train_cfg.global_batch_tokens // train_cfg.seq_len)
            pairs, self.pair_stats = policy_pairs(reference, self.tokenizer, self.train_tasks, wanted, seed=seed)
        else:
            pairs = task_preference_pairs(self.train_tasks, seed=seed)
        val_pairs = task_preference_pairs(self.heldout, seed=seed + 1)
        seq_len, divergence = cfg.train.seq_len, cfg.rejected_to_divergence
        rows, self.val_rows = (
            reference_logprobs(reference, pair_rows(self.tokenizer, p, seq_len, divergence), precision=precision)
            for p in (pairs, val_pairs)
        )
        micro, vocab = cfg.train.micro_batch_size, self.tokenizer.vocab_size
        self.pairs = len(rows)
        return (
            ExampleSource(rows, micro, seed=self.recipe.train.seed, vocab_size=vocab),
            ExampleSource(self.val_rows, micro, shuffle=False, vocab_size=vocab),
        )

    def loss_fn(self):
        return make_dpo_loss(self.cfg)

    def results(self, trainer, summary: dict, before: dict | None) -> dict:
        return {
            "pairs": self.pairs,
            **self.pair_stats,
            **super().results(trainer, summary, before),
            "heldout_preferences": preference_stats(
                trainer.model, self.val_rows, self.cfg.beta, self.recipe.train.precision
            ),
        }
