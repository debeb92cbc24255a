"""The post-training stages (`kiln sft`, `kiln dpo`, `kiln grpo`) on the spine's training loop.

Each stage starts from the previous stage's checkpoint, brings its data as a batch source and its
objective as a `loss_fn(model, batch) -> (loss, counted items)`, and otherwise trains, evaluates,
checkpoints and resumes exactly as pretraining does. After training it measures held-out accuracy
on Kiln's verifiable tasks, the headline number of every post-training stage.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.post.config import DPOConfig, TaskConfig

IGNORE = -100


# ---- held-out accuracy ---------------------------------------------------------------------------


def heldout_tasks(cfg: TaskConfig) -> list[dict]:
    from kiln.post.tasks import generate_tasks

    return [
        ex
        for i, family in enumerate(cfg.families)
        for ex in generate_tasks(
            family, cfg.heldout_per_family, split="heldout", difficulty=cfg.difficulty, seed=cfg.seed + 7919 * (i + 1)
        )
    ]


def train_tasks(cfg: TaskConfig) -> list[dict]:
    from kiln.post.tasks import generate_tasks

    return [
        ex
        for i, family in enumerate(cfg.families)
        for ex in generate_tasks(
            family, cfg.train_per_family, split="train", difficulty=cfg.difficulty, seed=cfg.seed + 104729 * (i + 1)
        )
    ]


@torch.no_grad()
def complete(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> list[list[int]]:
    """Completion ids of each prompt from the KV-cache engine; a completion that ended at a stop
    token (`<|end|>` or `<|endoftext|>`) keeps it, since RL trains on emitting it."""
    from kiln.infer.engine import Engine

    stop = (tokenizer.token_id("<|end|>"), tokenizer.eot_id)
    outs = Engine(model).generate(
        prompts, max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop, seed=seed
    )
    return [list(o.ids) for o in outs]


def strip_stop(tokenizer, ids: list[int]) -> list[int]:
    stop = {tokenizer.token_id("<|end|>"), tokenizer.eot_id}
    return ids[:-1] if ids and ids[-1] in stop else ids


def task_accuracy(model, tokenizer, examples: list[dict], max_new_tokens: int = 16) -> dict:
    """Greedy accuracy on `examples`, overall and per task family."""
    from kiln.data.chat import render_prompt
    from kiln.post.tasks import grade

    was_training = model.training
    model.eval()
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": ex["prompt"]}]) for ex in examples]
    completions = complete(model, tokenizer, prompts, max_new_tokens)
    model.train(was_training)
    scores: dict[str, list[float]] = {}
    for ex, ids in zip(examples, completions):
        scores.setdefault(ex["task"], []).append(grade(ex, tokenizer.decode(strip_stop(tokenizer, ids))))
    flat = [s for v in scores.values() for s in v]
    return {
        "accuracy": sum(flat) / len(flat),
        "examples": len(flat),
        "per_task": {k: sum(v) / len(v) for k, v in sorted(scores.items())},
    }


# ---- objectives ------------------------------------------------------------------------------------


def trimmed(targets: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cut [B, T] tensors after the last position that has a target in any row. Attention is causal,
    so the trailing padding changes nothing that is scored; rows padded to seq_len would otherwise
    run the model on ~3x the positions (bench/post.py)."""
    counted = (targets != IGNORE).any(0).nonzero()
    n = int(counted[-1]) + 1 if len(counted) else 1
    return tuple(t[:, :n] for t in (targets, *tensors))


def sft_loss(model, batch: tuple) -> tuple[torch.Tensor, int]:
    """Next-token cross-entropy on assistant tokens only; packed conversations are kept apart by
    document masking and restart their positions."""
    targets, inputs, positions, documents = trimmed(batch[1], batch[0], batch[2], batch[3])
    logits = model(inputs, position_ids=positions, document_ids=documents)
    counted = int((targets != IGNORE).sum())
    if counted == 0:
        return logits.sum() * 0.0, 0
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    return loss, counted


def _pair_logprobs(model, chosen, chosen_targets, rejected, rejected_targets):
    from kiln.post.losses import sequence_logprobs

    targets, inputs = trimmed(torch.cat([chosen_targets, rejected_targets]), torch.cat([chosen, rejected]))
    logits = model(inputs)
    mask = targets != IGNORE
    logps = sequence_logprobs(logits, targets, mask)
    return logps.chunk(2)


def make_dpo_loss(cfg: DPOConfig):
    """DPO (sigmoid, IPO or cDPO) on pre-computed reference log-probs, plus `nll_weight` times the
    per-token NLL of the chosen answers (RPO; OpenRLHF's nll_loss_coef). The NLL term keeps the
    likelihood of the correct answer from falling while the margin grows: without it, DPO on small,
    low-diversity pairs lowers both answers' likelihood and greedy accuracy with them."""
    from kiln.post.losses import dpo_loss

    loss_type = "sigmoid" if cfg.loss_type == "cdpo" else cfg.loss_type
    smoothing = cfg.label_smoothing if cfg.loss_type == "cdpo" else 0.0

    def loss_fn(model, batch: tuple) -> tuple[torch.Tensor, int]:
        chosen, chosen_t, rejected, rejected_t, ref_chosen, ref_rejected = batch
        pol_chosen, pol_rejected = _pair_logprobs(model, chosen, chosen_t, rejected, rejected_t)
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


def autocast(precision: str, device: torch.device | str = "cpu"):
    """The training loop's autocast for `precision`: reference log-probs computed under it equal the
    policy's at step 0, so DPO's margin starts at exactly zero (fp32 references under a bf16 policy
    would start it at the rounding difference)."""
    from kiln.train.trainer import PRECISION_DTYPES

    if precision == "fp32":
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=PRECISION_DTYPES[precision])


# ---- data ------------------------------------------------------------------------------------------


def _pad(ids: list[int], length: int, value: int) -> list[int]:
    return (ids + [value] * length)[:length]


def sft_rows(tokenizer, conversations: list[list[dict]], seq_len: int, packing: bool) -> tuple[list, dict]:
    from kiln.data.chat import render_conversation
    from kiln.post.data import pack_sft

    tokenized = [render_conversation(tokenizer, messages) for messages in conversations]
    pad = tokenizer.token_id("<|pad|>")
    if packing:
        packed = pack_sft(tokenized, seq_len, pad_id=pad)
        rows = [
            (
                torch.as_tensor(r.inputs),
                torch.as_tensor(r.targets),
                torch.as_tensor(r.position_ids),
                torch.as_tensor(r.document_ids),
            )
            for r in packed
        ]
    else:
        rows = []
        for ids, mask in tokenized:
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
            targets = [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])]
            n = len(ids) - 1
            rows.append(
                (
                    torch.tensor(_pad(ids[:-1], seq_len, pad)),
                    torch.tensor(_pad(targets, seq_len, IGNORE)),
                    torch.tensor(_pad(list(range(n)), seq_len, 0)),
                    torch.tensor([0] * n + [1] * (seq_len - n))[:seq_len],
                )
            )
    return rows, {
        "conversations": len(tokenized),
        "rows": len(rows),
        "assistant_tokens": sum(sum(m) for _, m in tokenized),
    }


def pair_rows(
    tokenizer, pairs: list[tuple[list[dict], str, str]], seq_len: int, rejected_to_divergence: bool = False
) -> list[tuple]:
    """(chosen ids, chosen targets, rejected ids, rejected targets) with loss on the answers only.

    `rejected_to_divergence` scores the rejected answer only up to its first token that differs
    from the chosen one. A near miss ("sun cat dog" for "sun dog cat") is wrong at that token; the
    tokens after it continue a wrong prefix and are often right in themselves, and pushing them down
    unlearns the skill the chosen answer uses (measured: held-out accuracy fell). The shared prefix
    scores the same in both sequences, so it cancels in the margin."""
    from kiln.data.chat import render_conversation

    pad = tokenizer.token_id("<|pad|>")
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
            row += [torch.tensor(_pad(ids[:-1], seq_len, pad)), torch.tensor(_pad(targets, seq_len, IGNORE))]
        rows.append(tuple(row))
    return rows


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
            ref_c, ref_r = _pair_logprobs(model, *parts)
        ref_c, ref_r = ref_c.cpu(), ref_r.cpu()
        out += [(*row, c, r) for row, c, r in zip(chunk, ref_c.float(), ref_r.float())]
    model.train(was_training)
    return out


def write_stats(out: Path, stats: dict) -> None:
    (Path(out) / "stats.json").write_text(json.dumps(stats, indent=2, default=str))
