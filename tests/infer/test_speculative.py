import itertools

import pytest
import torch
from kiln_testing.reference_generate import reference_generate

from kiln.errors import ConfigError
from kiln.infer.config import SamplingParams
from kiln.infer.engine import Engine
from kiln.infer.sampling import sampling_logits
from kiln.infer.speculative import SpeculativeEngine, accept_drafts
from kiln.model import ModelConfig, build_model

PROMPTS = [[5, 17, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [33, 2, 250, 7, 7]]


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed, **overrides):
    torch.manual_seed(seed)
    base = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=40, init_std=0.2)
    return build_model(ModelConfig(**{**base, **overrides})).eval()


def noisy_copy(model, scale, seed):
    """A draft that agrees with the target often but not always, so rows accept different numbers
    of proposals in the same step."""
    draft = tiny(
        0,
        **{k: getattr(model.cfg, k) for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len")},
    )
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return draft


@pytest.fixture(scope="module")
def target():
    return tiny(0)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft_kind", ["small", "noisy", "self"])
def test_greedy_output_equals_the_target_alone(target, k, draft_kind):
    draft = {
        "small": lambda: tiny(1, dim=16, n_layers=1, n_heads=2, n_kv_heads=1),
        "noisy": lambda: noisy_copy(target, 0.3, seed=k),
        "self": lambda: target,
    }[draft_kind]()
    spec = SpeculativeEngine(target, draft, k=k)
    outs = spec.generate(PROMPTS, 25, temperature=0)
    ref = Engine(target).generate(PROMPTS, 25, temperature=0)
    for prompt, out, expected in zip(PROMPTS, outs, ref):
        assert out.ids == expected.ids
        assert out.ids == reference_generate(target, prompt, 25, temperature=0)  # the uncached reference too
        assert out.finish_reason == expected.finish_reason
        assert out.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        assert out.sampling_logprobs == [0.0] * len(out.ids)
    stats = spec.stats
    assert stats.tokens == sum(len(o.ids) for o in outs)
    if draft_kind == "self":
        assert stats.accepted == stats.proposed
        # Every target pass but the prefill yields k + 1 tokens (fewer only at the end).
        assert stats.target_calls <= 1 + -(-25 // (k + 1)) + 1
    elif draft_kind == "noisy":
        assert 0 < stats.accepted < stats.proposed


def test_greedy_stops_like_the_engine(target):
    """Stop tokens, max_new_tokens and the model's max_seq_len end rows exactly as in Engine, even
    when the stop comes in the middle of a block of accepted proposals."""
    ref_free = Engine(target).generate(PROMPTS, 20, temperature=0)
    stop = [ref_free[0].ids[6], ref_free[2].ids[3]]
    spec = SpeculativeEngine(target, target, k=4)
    for kwargs in (dict(max_new_tokens=20, stop_token_ids=stop), dict(max_new_tokens=100)):
        outs = spec.generate(PROMPTS, temperature=0, **kwargs)
        ref = Engine(target).generate(PROMPTS, temperature=0, **kwargs)
        assert [o.ids for o in outs] == [r.ids for r in ref]
        assert [(o.finish_reason, o.stop) for o in outs] == [(r.finish_reason, r.stop) for r in ref]
    assert len(outs[1].ids) == 40 - len(PROMPTS[1])  # ran into max_seq_len


def test_text_and_stop_strings_match_the_engine(target, byte_tokenizer):
    draft = noisy_copy(target, 0.3, seed=0)
    free = Engine(target, byte_tokenizer).generate(PROMPTS, 20, temperature=0)
    stop = free[1].text[5:8]
    spec = SpeculativeEngine(target, draft, byte_tokenizer, k=3)
    outs = spec.generate(PROMPTS, 20, temperature=0, stop_strings=[stop])
    ref = Engine(target, byte_tokenizer).generate(PROMPTS, 20, temperature=0, stop_strings=[stop])
    assert [(o.ids, o.text, o.finish_reason, o.stop) for o in outs] == [
        (r.ids, r.text, r.finish_reason, r.stop) for r in ref
    ]
    assert outs[1].stop == stop and not outs[1].text.endswith(stop)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's goodness-of-fit p-value; cells expected below min_expected are pooled into one."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < min_expected
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("k", [1, 3])
def test_acceptance_rule_emits_the_target_distribution(k):
    """One step of the rule with fixed distributions: the first emitted token (a kept proposal or
    the replacement) is distributed as p, not as q. 40000 rows in one vectorised call."""
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 6, 40_000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)
    p[:, 2] = 0.0  # a token the target never emits but the draft proposes
    p = p / p.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[i], rows, replacement=True, generator=gen) for i in range(k)], 1)
    generators = [torch.Generator().manual_seed(1000 + r) for r in range(rows)]
    accepted, nxt = accept_drafts(p.expand(rows, -1, -1), q.expand(rows, -1, -1), drafts, generators)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    counts = torch.bincount(first, minlength=vocab)
    assert counts[2] == 0
    assert chi_square_p(counts, p[0]) > 1e-3
    assert chi_square_p(counts, q[0]) < 1e-6  # the test can tell p from q at this size
    # The expected number of kept first proposals is sum_x min(p(x), q(x)).
    assert (accepted > 0).float().mean() == pytest.approx(torch.minimum(p[0], q[0]).sum().item(), abs=0.01)


def sequence_probs(model, prompt, length, params):
    """Exact probability of every continuation of `length` tokens under the sampling distribution,
    from one uncached forward over all of them."""
    vocab = model.cfg.vocab_size
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))
    tokens = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = model(tokens)[:, len(prompt) - 1 : -1].float()
    probs = sampling_logits(logits.reshape(-1, vocab), params).softmax(-1).view(len(seqs), length, vocab)
    return probs.gather(2, seqs[:, :, None])[..., 0].prod(1), seqs


@pytest.mark.parametrize("filters", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_sampled_sequences_follow_the_target_distribution(filters):
    """End to end, with KV caches: 3-token continuations over a 6-token vocabulary from 3000 rows
    fit the target's exact distribution (216 outcomes) and not the draft's."""
    shape = dict(vocab_size=6, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=16, init_std=0.6)
    target = tiny(3, **shape)
    draft = tiny(4, **{**shape, "n_layers": 1})
    prompt, rows, length = [1, 4, 2], 3000, 3
    spec = SpeculativeEngine(target, draft, k=2)
    outs = spec.generate([prompt] * rows, length, seed=0, **filters)
    assert 0 < spec.stats.accepted < spec.stats.proposed
    params = SamplingParams(**{"temperature": 1.0, **filters})
    p, seqs = sequence_probs(target, prompt, length, params)
    q, _ = sequence_probs(draft, prompt, length, params)
    index = {tuple(s): i for i, s in enumerate(seqs.tolist())}
    counts = torch.bincount(torch.tensor([index[tuple(o.ids)] for o in outs]), minlength=len(seqs))
    assert chi_square_p(counts, p) > 1e-3
    assert chi_square_p(counts, q) < 1e-6


def test_sampling_is_reproducible_and_logprobs_are_the_targets(target):
    draft = noisy_copy(target, 0.3, seed=1)
    spec = SpeculativeEngine(target, draft, k=3)
    a = spec.generate(PROMPTS, 15, temperature=0.8, top_p=0.9, seed=7)
    b = spec.generate(PROMPTS, 15, temperature=0.8, top_p=0.9, seed=7)
    assert [o.ids for o in a] == [o.ids for o in b]
    for prompt, out in zip(PROMPTS, a):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + out.ids]))[0, len(prompt) - 1 : -1].float()
        chosen = torch.tensor(out.ids)[:, None]
        assert out.logprobs == pytest.approx(logits.log_softmax(-1).gather(1, chosen)[:, 0].tolist(), abs=1e-4)
        sampled = sampling_logits(logits, SamplingParams(0.8, top_p=0.9)).log_softmax(-1).gather(1, chosen)[:, 0]
        assert out.sampling_logprobs == pytest.approx(sampled.tolist(), abs=1e-4)


def test_bad_configurations_name_the_key(target):
    with pytest.raises(ConfigError, match="draft"):
        SpeculativeEngine(target, tiny(1, vocab_size=299))
    with pytest.raises(ConfigError, match="draft"):
        SpeculativeEngine(target, tiny(1, max_seq_len=20))
    with pytest.raises(ConfigError, match="k"):
        SpeculativeEngine(target, target, k=0)
    with pytest.raises(ConfigError, match="top_p"):
        SpeculativeEngine(target, target).generate(PROMPTS, 5, top_p=0.0)
    with pytest.raises(ConfigError, match="prompts"):
        SpeculativeEngine(target, target).generate([[]], 5)


def test_a_repetition_penalty_is_refused_by_name():
    target = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=32)).eval()
    draft = build_model(ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=32)).eval()
    engine = SpeculativeEngine(target, draft, k=2)
    assert len(engine.generate([[1, 2]], 4, temperature=0, repetition_penalty=1.0)[0].ids) == 4
    with pytest.raises(ConfigError) as err:
        engine.generate([[1, 2]], 4, temperature=0, repetition_penalty=1.3)
    assert err.value.key == "repetition_penalty"
