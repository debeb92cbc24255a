"""Prefix caching in the serving scheduler (kiln/serve/prefix_cache.py): with the cache on, every
request gets the tokens and log-probabilities it gets with the cache off, while the prefixes it
shares with earlier prompts are not forwarded again."""

import argparse

import httpx
import pytest
import torch
from kiln_testing.serving import serving, tiny_checkpoint

from kiln.errors import ConfigError
from kiln.infer.config import SamplingParams
from kiln.infer.engine import Engine
from kiln.infer.kv_cache import KVCache
from kiln.model import ModelConfig, build_model
from kiln.model.config import RopeScaling
from kiln.serve import cli as serve_cli
from kiln.serve.prefix_cache import DEFAULT_MB, PrefixCache, fit_prefixes, from_megabytes
from kiln.serve.requests import GenerationRequest, PromptScores
from kiln.serve.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 16
# A common prefix of 60 tokens (a system prompt, say); the prompts below take 16 to all 60 of it.
SHARED = [(7 * i + 3) % 290 + 5 for i in range(60)]


torch.manual_seed(0)
MODEL = build_model(
    ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128, init_std=0.2)
).eval()


@pytest.fixture(scope="module")
def model():
    return MODEL


@pytest.fixture
def scheduler_for():
    made = []

    def make(model, **kwargs):
        made.append(Scheduler(model, max_batch=16, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def request(prompt, **kwargs):
    return GenerationRequest(list(prompt), 8, SamplingParams(temperature=0), logprobs=3, **kwargs)


def outputs(handle):
    """(prompt scores or None, [(token, logprob, top)]) of one request."""
    scores, tokens = None, []
    for event in handle:
        if isinstance(event, PromptScores):
            scores = event
        else:
            tokens.append((event.id, event.logprob, event.top))
    return scores, tokens


def alone(scheduler, prompts, **kwargs):
    """Each prompt's outputs, prefilled one after another."""
    return [outputs(scheduler.submit([request(p, **kwargs)])[0]) for p in prompts]


def together(scheduler, prompts, **kwargs):
    """The prompts' outputs, prefilled as one batch."""
    before = scheduler.stats["prefills"]
    handles = scheduler.submit([request(p, **kwargs) for p in prompts])
    out = [outputs(h) for h in handles]
    assert scheduler.stats["prefills"] == before + 1  # really one batched prefill
    return out


def engine_checked(prompts, outs):
    """outs, after checking their tokens and logprobs against Engine.generate on each prompt alone:
    the cache-off reference runs the scheduler's own code, which must not share a bug with the
    cache-on path unnoticed."""
    for prompt, (_, tokens) in zip(prompts, outs):
        [engine] = Engine(MODEL).generate([prompt], 8, temperature=0)
        assert [t for t, _, _ in tokens] == engine.ids
        assert [lp for _, lp, _ in tokens] == pytest.approx(engine.logprobs, abs=1e-5)
    return outs


def assert_same(got, want):
    """Greedy tokens equal, their logprobs and top-k logprobs within 1e-5."""
    (got_scores, got_tokens), (want_scores, want_tokens) = got, want
    assert [t for t, _, _ in got_tokens] == [t for t, _, _ in want_tokens]
    for (_, lp, top), (_, want_lp, want_top) in zip(got_tokens, want_tokens):
        assert lp == pytest.approx(want_lp, abs=1e-5)
        assert [i for i, _ in top] == [i for i, _ in want_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-5)
    assert (got_scores is None) == (want_scores is None)
    if want_scores is not None:
        assert got_scores.logprobs[0] is None and want_scores.logprobs[0] is None
        assert got_scores.logprobs[1:] == pytest.approx(want_scores.logprobs[1:], abs=1e-5)


@torch.inference_mode()
def test_kv_cache_appends_several_tokens_to_rows_of_different_lengths(model):
    """What a prefill with reused prefixes relies on: rows already holding 8 and 16 tokens get their
    right-padded rests (12 and 14 tokens) in one forward, and each position's logits are those of
    the whole prompt forwarded alone (KVCache.prepare's masked path)."""
    prompts, cached = [SHARED[:20], SHARED[30:60]], [8, 16]
    cache = KVCache.for_model(model, 2, 40)
    first = torch.zeros(2, 16, dtype=torch.long)
    for i, (prompt, p) in enumerate(zip(prompts, cached)):
        first[i, :p] = torch.tensor(prompt[:p])
    model(first, kv_cache=cache)
    cache.set_lengths(cached)
    rest = torch.zeros(2, 14, dtype=torch.long)
    for i, (prompt, p) in enumerate(zip(prompts, cached)):
        rest[i, : len(prompt) - p] = torch.tensor(prompt[p:])
    logits = model(rest, kv_cache=cache)
    for i, (prompt, p) in enumerate(zip(prompts, cached)):
        whole = model(torch.tensor([prompt]))[0]
        torch.testing.assert_close(logits[i, : len(prompt) - p], whole[p:], atol=1e-5, rtol=1e-5)


def test_tokens_and_logprobs_equal_with_the_cache_off_in_and_across_batched_prefills(model, scheduler_for):
    first = SHARED + [11, 12, 13]  # 63 tokens: its first 48 are stored
    batch = [
        SHARED + [21, 22, 23, 24, 25],  # reuses 48
        SHARED[:40] + [31, 32, 33],  # its 3rd block differs from the stored one: reuses 32
        SHARED[:16] + [41, 42, 43, 44],  # reuses 16
        [51, 52, 53, 54, 55, 56, 57],  # shorter than a block: reuses nothing
        SHARED[:40] + [61] * 30,  # 70 tokens, the longest rest (38): reuses 32
    ]
    later = [SHARED + list(range(100, 140)), SHARED + list(range(100, 140)) + [9, 9], SHARED[:50] + [7] * 3]
    want = engine_checked([first, *batch, *later], alone(scheduler_for(model), [first, *batch, *later]))

    cache = PrefixCache(1 << 20, BLOCK)
    scheduler = scheduler_for(model, prefix_cache=cache)
    got = alone(scheduler, [first])
    assert cache.stats["entries"] == 1 and cache.stats["hits"] == 0 and cache.stats["misses"] == 1
    # Rows at 48, 32, 16 and 0 cached tokens in one prefill, each forwarding the rest of its prompt.
    assert [cache.match(p) for p in batch] == [48, 32, 16, 0, 32]
    got += together(scheduler, batch)
    assert cache.stats["hits"] == 4 and cache.stats["tokens_reused"] == 48 + 32 + 16 + 32
    # Across prefills: the 100-token prompt reuses 48 and stores 96, which the next one reuses.
    got += alone(scheduler, later)
    assert cache.stats["hits"] == 4 + 3
    assert cache.stats["tokens_reused"] == 128 + 48 + 96 + 48
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)


def test_a_block_multiple_prompt_stores_all_but_its_last_block_and_a_short_one_nothing(model, scheduler_for):
    cache = PrefixCache(1 << 20, BLOCK)
    scheduler = scheduler_for(model, prefix_cache=cache)
    reference = scheduler_for(model)
    exact, short = SHARED[:32], SHARED[:5]
    first = alone(scheduler, [exact, short])
    # Never the whole prompt: its last token must be forwarded for the next token's logits.
    assert cache.match(exact) == 16 and cache.match(short) == 0 and cache.stats["entries"] == 1
    assert cache.stats["bytes"] == KVCache.nbytes(model, 1, 16)
    again = alone(scheduler, [exact, short, SHARED[:16]])  # 16 tokens: reuses nothing, stores nothing
    assert cache.stats["hits"] == 1 and cache.stats["tokens_reused"] == 16 and cache.stats["entries"] == 1
    want = engine_checked([exact, short, SHARED[:16]], alone(reference, [exact, short, SHARED[:16]]))
    for g, w in zip(first + again, want[:2] + want):
        assert_same(g, w)


def test_prompt_logprobs_requests_bypass_the_cache_and_stay_exact(model, scheduler_for):
    cache = PrefixCache(1 << 20, BLOCK)
    scheduler = scheduler_for(model, prefix_cache=cache)
    prompts = [SHARED + [1, 2], SHARED + [3, 4, 5]]
    alone(scheduler, prompts[:1])
    assert cache.match(prompts[1]) == 48
    hits = cache.stats["hits"], cache.stats["misses"]
    echo = together(scheduler, prompts, prompt_logprobs=True)  # both need every position's logits
    assert (cache.stats["hits"], cache.stats["misses"]) == hits  # neither looked the cache up
    want = engine_checked(prompts, together(scheduler_for(model), prompts, prompt_logprobs=True))
    for g, w in zip(echo, want):
        assert len(g[0].logprobs) == len(w[0].logprobs)
        assert_same(g, w)
    # In one batch with a request that does reuse its prefix.
    mixed = [outputs(h) for h in scheduler.submit([request(prompts[1], prompt_logprobs=True), request(prompts[1])])]
    assert cache.stats["hits"] == hits[0] + 1
    assert_same(mixed[0], want[1])
    assert_same(mixed[1], (None, want[1][1]))


def test_reused_prefixes_are_cut_to_fit_the_context(model, scheduler_for):
    """Rests are right-padded after each row's prefix: 112 cached + a 100-token rest > 128 slots."""
    cache = PrefixCache(1 << 20, BLOCK)
    scheduler = scheduler_for(model, prefix_cache=cache)
    long_one = SHARED + list(range(100, 160))  # 120 tokens: stores 112
    alone(scheduler, [long_one])
    other = list(range(150, 250))  # 100 tokens, nothing cached
    assert fit_prefixes([120, 100], [112, 0], 128, BLOCK) == [16, 0]  # 16 + 104 <= 128
    got = together(scheduler, [long_one[:-1] + [5], other])
    want = engine_checked([long_one[:-1] + [5], other], alone(scheduler_for(model), [long_one[:-1] + [5], other]))
    assert cache.stats["tokens_reused"] == 16
    for g, w in zip(got, want):
        assert_same(g, w)


LAYERS, HEADS, DIM, SMALL = 2, 2, 4, 4  # a cached token costs 2 * 2 * 4 float32s, for k and v: 128 bytes
PROMPTS = {name: [first] * SMALL + [0] for first, name in enumerate("abcde", 1)}  # one block stored each


def entries(cache, *names):
    """Whether each name's prompt has its block stored."""
    return [cache.match(PROMPTS[n]) > 0 for n in names]


def kv(n, fill):
    return torch.full((LAYERS, HEADS, n, DIM), float(fill)), torch.full((LAYERS, HEADS, n, DIM), -float(fill))


def test_eviction_keeps_the_budget_and_drops_the_least_recently_used():
    per_entry = 2 * LAYERS * HEADS * SMALL * DIM * 4  # 512 bytes
    cache = PrefixCache(3 * per_entry + 100, SMALL)
    for fill, name in enumerate("abc", 1):
        cache.store(PROMPTS[name], *kv(SMALL + 1, fill))
    assert cache.stats["entries"] == 3 and cache.stats["bytes"] == 3 * per_entry
    k, v = cache.take(PROMPTS["a"], SMALL)  # a is now the most recently used, b the least
    assert torch.equal(k, kv(SMALL, 1)[0]) and torch.equal(v, kv(SMALL, 1)[1])
    cache.store(PROMPTS["d"], *kv(SMALL + 1, 4))
    assert entries(cache, "a", "b", "c", "d") == [True, False, True, True]
    assert cache.stats["evictions"] == 1 and cache.stats["bytes"] <= cache.budget
    cache.store(PROMPTS["c"], *kv(SMALL + 1, 3))  # stored already: only marked recently used
    cache.store(PROMPTS["e"], *kv(SMALL + 1, 5))  # evicts a (c was just used, then d)
    assert entries(cache, "a", "c", "d", "e") == [False, True, True, True]
    assert cache.stats["bytes"] == 3 * per_entry <= cache.budget
    # A prompt longer than the budget keeps as many whole blocks as fit (3), evicting everything else.
    long_prompt = list(range(1, 30))
    cache.store(long_prompt, *kv(29, 9))
    assert cache.match(long_prompt) == 3 * SMALL and cache.stats["entries"] == 1
    assert cache.stats["bytes"] == 3 * per_entry <= cache.budget


def test_a_longer_prefix_replaces_the_stored_prefixes_it_starts_with():
    cache = PrefixCache(1 << 20, SMALL)
    prompt = list(range(1, 14))  # 13 tokens: 3 blocks stored
    cache.store(prompt[:6], *kv(6, 1))  # 1 block
    cache.store(prompt[:10], *kv(10, 2))  # 2 blocks, starting with the stored one
    assert cache.stats["entries"] == 1 and cache.match(prompt) == 8
    cache.store(prompt, *kv(13, 3))
    assert cache.stats["entries"] == 1 and cache.match(prompt) == 12 and cache.match(prompt[:7]) == 4
    k, _ = cache.take(prompt[:7], 4)
    assert torch.equal(k, kv(4, 3)[0])
    cache.store(prompt[:9], *kv(9, 4))  # held already, by the longer entry
    assert cache.stats["entries"] == 1
    with pytest.raises(ValueError, match="no stored prefix"):
        cache.take([99] * 9, 4)


def test_bad_budgets_are_refused_by_name(model):
    with pytest.raises(ConfigError, match="prefix_cache_mb: must be >= 0"):
        from_megabytes(model, -1)
    assert from_megabytes(model, 0) is None
    assert from_megabytes(model, None).budget == int(DEFAULT_MB * 2**20)
    with pytest.raises(ConfigError, match="budget_bytes"):
        PrefixCache(0)
    dynamic = build_model(
        ModelConfig(
            vocab_size=300, dim=32, n_layers=1, n_heads=4, max_seq_len=64,
            rope_scaling=RopeScaling(type="dynamic", factor=2.0, original_max_seq_len=32),
        )
    )  # fmt: skip
    assert from_megabytes(dynamic, None) is None  # the default is off for it
    with pytest.raises(ConfigError, match="prefix_cache_mb: cannot be used with dynamic RoPE"):
        from_megabytes(dynamic, 8)
    with pytest.raises(ConfigError, match="prefix_cache: cannot be used with dynamic RoPE"):
        Scheduler(dynamic, prefix_cache=PrefixCache(1 << 20))


def serve_args(checkpoint, *extra):
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers(dest="verb"))
    return parser.parse_args(["serve", str(checkpoint), "--device", "cpu", *extra])


def test_the_cli_option_reaches_the_scheduler_and_health(tmp_path, monkeypatch):
    checkpoint = tiny_checkpoint(tmp_path, tmp_path / "ckpt")
    apps = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: apps.append(app))
    assert serve_cli.run_serve(serve_args(checkpoint, "--prefix-cache-mb", "2")) == 0
    assert serve_cli.run_serve(serve_args(checkpoint, "--prefix-cache-mb", "0")) == 0
    assert serve_cli.run_serve(serve_args(checkpoint)) == 0
    on, off, default = apps
    with serving(on) as (base, _):
        assert on.state.scheduler.prefix_cache.budget == 2 << 20
        prompt = list(range(1, 40))
        for _ in range(2):
            body = {"model": str(checkpoint), "prompt": prompt, "max_tokens": 2, "temperature": 0}
            assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
        stats = httpx.get(base + "/health").json()["prefix_cache"]
        assert stats["hits"] == 1 and stats["tokens_reused"] == 32 and stats["entries"] == 1 and stats["bytes"] > 0
    with serving(off) as (base, _):
        assert off.state.scheduler.prefix_cache is None
        assert "prefix_cache" not in httpx.get(base + "/health").json()
    assert default.state.serve.prefix_cache.budget == int(DEFAULT_MB * 2**20)
    with pytest.raises(ConfigError, match=r"--prefix-cache-mb: must be >= 0 \(0 is off\), got -1"):
        serve_cli.run_serve(serve_args(checkpoint, "--prefix-cache-mb", "-1"))
