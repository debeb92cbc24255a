"""The uncached reference generator (reference_generate.py) is what it claims to be; the engine's
tests check the engine against it."""

import pytest
import torch
from kiln_testing.reference_generate import reference_generate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_greedy_is_the_argmax_loop(byte_model):
    prompt = [5, 17, 42]
    context = list(prompt)
    with torch.no_grad():
        for _ in range(20):  # runs past max_seq_len=16, so cropping is exercised too
            logits = byte_model(torch.tensor([context[-16:]]))[0, -1]
            context.append(int(logits.argmax()))
    assert reference_generate(byte_model, prompt, 20, temperature=0) == context[len(prompt) :]
    # top-k=1 keeps only the argmax, so sampling at any temperature is greedy.
    assert (
        reference_generate(byte_model, prompt, 20, temperature=1.3, top_k=1, generator=torch.Generator().manual_seed(3))
        == context[len(prompt) :]
    )


def test_greedy_repetition_penalty_is_the_penalised_argmax_loop(byte_model):
    prompt = [5, 17, 42]
    context = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            logits = byte_model(torch.tensor([context]))[0, -1]
            for token in set(context):
                logits[token] = logits[token] * 3.0 if logits[token] < 0 else logits[token] / 3.0
            context.append(int(logits.argmax()))
    assert reference_generate(byte_model, prompt, 10, temperature=0, repetition_penalty=3.0) == context[len(prompt) :]


def test_seeded_sampling_is_reproducible_and_seed_dependent(byte_model):
    runs = [
        reference_generate(byte_model, [1, 2], 12, temperature=1.0, generator=torch.Generator().manual_seed(s))
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stop_ids_end_generation_without_the_stop_token(byte_model):
    full = reference_generate(byte_model, [3], 10, temperature=0)
    stop_at = full[4]
    first = full.index(stop_at)
    assert reference_generate(byte_model, [3], 10, temperature=0, stop_ids=(stop_at,)) == full[:first]
