"""Choosing the next token from logits under SamplingParams: the repetition penalty, temperature,
top-k, top-p and min-p filters, and the draw itself with each row's own generator. The engine, the
speculative engine and the server's scheduler all sample through these functions.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kiln.infer.config import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set whose probability
    reaches top_p (Holtzman et al. 2019). logits: [..., vocab]; returns a new tensor."""
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth_largest] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token never is.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop_sorted[..., 0] = False  # a top_p below float32's range rounds to 0 and would drop every token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al. 2019) as transformers applies it: a token already in the prompt
    or the completion has a positive logit divided by `penalty` and a negative one multiplied by it."""
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's (Nguyen et al. 2024)."""
    if min_p <= 0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def sampling_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, vocab] whose softmax is the distribution a token is drawn from (temperature > 0),
    in transformers' order: repetition penalty, temperature, top-k, top-p, min-p. seen [B, vocab]
    marks the tokens already in each row (needed for the repetition penalty)."""
    if seen is not None and params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    return min_p_filter(logits, params.min_p)


def sample_next_tokens(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None, generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Next token of each row of logits [B, vocab] (row r draws from generators[r]) and its
    log-probabilities: under the model (temperature 1), under the model at the sampling temperature,
    and under the distribution actually sampled from."""
    logprobs = logits.log_softmax(dim=-1)
    if params.temperature == 0:
        scores = apply_repetition_penalty(logits, seen, params.repetition_penalty) if seen is not None else logits
        tokens = scores.argmax(dim=-1)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        # Greedy picks its token with probability 1 and has no sampling temperature to scale by.
        return tokens.tolist(), chosen.tolist(), chosen.tolist(), [0.0] * len(generators)
    final = sampling_logits(logits, params, seen)
    probs = final.softmax(dim=-1)
    tokens = torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generators)])
    index = tokens[:, None]
    return (
        tokens.tolist(),
        logprobs.gather(1, index)[:, 0].tolist(),
        (logits / params.temperature).log_softmax(dim=-1).gather(1, index)[:, 0].tolist(),
        final.log_softmax(dim=-1).gather(1, index)[:, 0].tolist(),
    )
