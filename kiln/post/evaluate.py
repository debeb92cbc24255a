"""Greedy completions and held-out task accuracy, the headline number of every post-training stage.

`complete` runs the KV-cache engine (also for RL rollouts and teacher answers); `rollout_logprobs`
scores the sampled tokens as the RL losses will; `task_outcomes` grades the greedy completion of
each held-out task problem exactly, and `task_accuracy` sums them overall and per task family.
"""

from __future__ import annotations

import torch

from kiln.data.chat import render_prompt
from kiln.infer.engine import Engine
from kiln.post.losses import token_logprobs
from kiln.post.tasks import grade
from kiln.train.precision import autocast


@torch.no_grad()
def complete(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> list[list[int]]:
    """Completion ids of each prompt from the KV-cache engine; a completion that ended at a stop
    token (`<|end|>` or `<|endoftext|>`) keeps it, since RL trains on emitting it."""
    stop = (tokenizer.token_id("<|end|>"), tokenizer.eot_id)
    outs = Engine(model).generate(
        prompts, max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop, seed=seed
    )
    return [list(o.ids) for o in outs]


@torch.no_grad()
def rollout_logprobs(
    model, inputs: torch.Tensor, targets: torch.Tensor, temperature: float, precision: str
) -> torch.Tensor:
    """Token log-probs [B, T] (CPU, float32) of `targets` under `model` in eval mode, in one forward
    under the training precision and at the sampling temperature: what the loss computes for the
    same weights, so a policy's old log-probs give ratio 1 and a reference's give KL 0 at the start."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with autocast(precision, device):
            return token_logprobs(model(inputs.to(device)), targets.to(device), temperature).float().cpu()
    finally:
        model.train(was_training)


def strip_stop(tokenizer, ids: list[int]) -> list[int]:
    stop = {tokenizer.token_id("<|end|>"), tokenizer.eot_id}
    return ids[:-1] if ids and ids[-1] in stop else ids


def task_outcomes(model, tokenizer, examples: list[dict], max_new_tokens: int = 16) -> list[float]:
    """The grade (0 or 1) of the greedy completion of each of `examples`, in order: what paired
    comparisons of two checkpoints on the same problems (which problems one solved and the other
    lost) are made from."""
    was_training = model.training
    model.eval()
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": ex["prompt"]}]) for ex in examples]
    completions = complete(model, tokenizer, prompts, max_new_tokens)
    model.train(was_training)
    return [grade(ex, tokenizer.decode(strip_stop(tokenizer, ids))) for ex, ids in zip(examples, completions)]


def task_accuracy(model, tokenizer, examples: list[dict], max_new_tokens: int = 16) -> dict:
    """Greedy accuracy on `examples`, overall and per task family."""
    scores: dict[str, list[float]] = {}
    for ex, score in zip(examples, task_outcomes(model, tokenizer, examples, max_new_tokens)):
        scores.setdefault(ex["task"], []).append(score)
    flat = [s for v in scores.values() for s in v]
    return {
        "accuracy": sum(flat) / len(flat),
        "examples": len(flat),
        "per_task": {k: sum(v) / len(v) for k, v in sorted(scores.items())},
    }


def accuracy_line(name: str, before: dict, after: dict) -> str:
    """The closing line of a stage measured by task accuracy."""
    return (
        f"[{name}] held-out task accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
        f"({', '.join(f'{k} {v:.2f}' for k, v in after['per_task'].items())})"
    )
