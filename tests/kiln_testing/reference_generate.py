"""The uncached reference generator the engine is checked against: every new token reruns the model
over the whole context (cropped to max_seq_len, keeping the most recent tokens), one prompt at a
time, with no KV cache, no batching and no padding. It shares only the logit filters with the engine
(kiln.infer.sampling, checked against transformers' processors in test_engine.py), so cache layout,
per-row lengths, the repetition penalty's record of seen tokens and the seeded draws are checked.
"""

from __future__ import annotations

import torch

from kiln.infer.config import SamplingParams
from kiln.infer.sampling import apply_repetition_penalty, sampling_logits


@torch.inference_mode()
def reference_generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    generator: torch.Generator | None = None,
    stop_ids=(),
) -> list[int]:
    """New token ids after prompt_ids (the stop token that ended generation is not included).
    temperature 0 is greedy; `generator` (on the model's device) makes sampling reproducible: with
    torch.Generator().manual_seed(seed + i) it draws what Engine.generate(..., seed=seed) draws for
    row i."""
    if not prompt_ids:
        raise ValueError("reference_generate: prompt_ids is empty")
    params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    max_len = model.cfg.max_seq_len
    context = list(prompt_ids)
    new_tokens: list[int] = []
    try:
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([context[-max_len:]], device=device))[0, -1].float()[None]
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[0, context] = True
            if params.temperature == 0:
                token = int(apply_repetition_penalty(logits, seen, params.repetition_penalty).argmax())
            else:
                probs = sampling_logits(logits, params, seen).softmax(dim=-1)[0]
                token = int(torch.multinomial(probs, 1, generator=generator))
            if token in stop_ids:
                break
            new_tokens.append(token)
            context.append(token)
    finally:
        model.train(was_training)
    return new_tokens
