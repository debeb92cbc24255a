import math

import pytest
import torch

from kiln.infer.config import SampleConfig
from kiln.infer.sample import filter_logits, generate, sample_texts
from kiln.model import ModelConfig, build_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=2, max_seq_len=16, init_std=0.2)
    return build_model(cfg).eval()


def test_greedy_is_the_argmax_loop(model):
    prompt = [5, 17, 42]
    context = list(prompt)
    with torch.no_grad():
        for _ in range(20):  # runs past max_seq_len=16, so cropping is exercised too
            logits = model(torch.tensor([context[-16:]]))[0, -1]
            context.append(int(logits.argmax()))
    assert generate(model, prompt, 20, temperature=0) == context[len(prompt) :]
    # top-k=1 keeps only the argmax, so sampling at any temperature is greedy.
    assert (
        generate(model, prompt, 20, temperature=1.3, top_k=1, generator=torch.Generator().manual_seed(3))
        == context[len(prompt) :]
    )


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    runs = [generate(model, [1, 2], 12, temperature=1.0, generator=torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_stop_ids_end_generation_without_the_stop_token(model):
    full = generate(model, [3], 10, temperature=0)
    stop_at = full[4]
    first = full.index(stop_at)
    assert generate(model, [3], 10, temperature=0, stop_ids=(stop_at,)) == full[:first]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    kept = lambda p: set(torch.isfinite(filter_logits(logits, top_p=p)).nonzero().flatten().tolist())  # noqa: E731
    assert kept(0.5) == {1}
    assert kept(0.7) == {1, 3}
    assert kept(0.81) == {1, 3, 2}
    assert kept(1.0) == {0, 1, 2, 3}
    # top-k and top-p combine: top-k first, then the nucleus of what is left.
    assert set(torch.isfinite(filter_logits(logits, top_k=2, top_p=0.99)).nonzero().flatten().tolist()) == {1, 3}


def test_top_p_restricts_sampled_support(model):
    prompt = [9, 8, 7]
    with torch.no_grad():
        probs = model(torch.tensor([prompt]))[0, -1].softmax(-1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    allowed = set(order[: int((cumulative < 0.6).sum()) + 1].tolist())
    generator = torch.Generator().manual_seed(0)
    seen = {generate(model, prompt, 1, temperature=1.0, top_p=0.6, generator=generator)[0] for _ in range(200)}
    assert seen <= allowed
    assert len(allowed) == 1 or len(seen) > 1


def test_temperature_flattens_or_sharpens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    generator = torch.Generator().manual_seed(0)
    cold = torch.multinomial((logits / 0.05).softmax(-1), 500, replacement=True, generator=generator)
    assert (cold == 0).all()
    assert math.isclose(filter_logits(logits).sum().item(), 3.0)  # no filtering leaves logits unchanged


def test_sample_texts_are_continuations_and_reproducible(model, byte_tokenizer):
    tokenizer = byte_tokenizer  # vocab 270, within the model's 300
    cfg = SampleConfig(prompt="def ", max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.9, num_samples=3, seed=4)
    texts = sample_texts(model, tokenizer, cfg)
    assert len(texts) == 3
    # Each text is exactly the decoded continuation the sampler produced from [eot] + prompt.
    generator = torch.Generator().manual_seed(4)
    prompt_ids = [tokenizer.eot_id] + tokenizer.encode("def ")
    for text in texts:
        new = generate(
            model,
            prompt_ids,
            8,
            temperature=0.9,
            top_k=20,
            top_p=0.9,
            generator=generator,
            stop_ids=(tokenizer.eot_id,),
        )
        assert text == tokenizer.decode(new)
    assert sample_texts(model, tokenizer, cfg) == texts
