import pytest
import torch
from kiln_testing.models import Scripted
from kiln_testing.reference_generate import reference_generate

from kiln.errors import ConfigError
from kiln.infer.config import SamplingParams
from kiln.infer.engine import Engine, TextStream
from kiln.infer.kv_cache import KVCache
from kiln.infer.sampling import apply_repetition_penalty, min_p_filter, sampling_logits
from kiln.model import ModelConfig, build_model

PROMPTS = [[5, 17, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [33, 2, 250, 7, 7]]


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(**overrides):
    torch.manual_seed(0)
    base = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, max_seq_len=40, init_std=0.2)
    return build_model(ModelConfig(**{**base, **overrides})).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model(n_kv_heads=2)


@pytest.mark.parametrize(
    "overrides",
    [
        {"n_kv_heads": 2},
        {"n_kv_heads": 1, "qkv_bias": True},
        {"pos": "learned", "norm": "layernorm"},
        {"pos": "sinusoidal", "tie_embeddings": True},
    ],
)
def test_cached_greedy_equals_uncached_reference(overrides):
    model = tiny_model(**overrides)
    # 40 new tokens would pass max_seq_len=40 for every prompt, so each row also stops at the limit.
    outs = Engine(model).generate(PROMPTS, 40, temperature=0)
    for prompt, out in zip(PROMPTS, outs):
        assert out.ids == reference_generate(model, prompt, 40 - len(prompt), temperature=0)
        assert out.finish_reason == "length" and len(prompt) + len(out.ids) == 40
    short = Engine(model).generate(PROMPTS, 6, temperature=0)
    assert [o.ids for o in short] == [o.ids[:6] for o in outs]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.3, min_p=0.05, repetition_penalty=1.4),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=0.8),
        SamplingParams(temperature=0, repetition_penalty=1.6),
    ],
)
def test_cached_seeded_sampling_equals_uncached_reference(model, params):
    """Row i of a batch seeded with `seed` draws what the reference draws, one prompt at a time and
    with no cache, from a generator seeded with seed + i; a stop token ends both at the same place."""
    kwargs = vars(params)
    outs = Engine(model).generate(PROMPTS, 14, **kwargs, seed=11)
    stop = outs[0].ids[3]
    stopped = Engine(model).generate(PROMPTS, 14, **kwargs, stop_token_ids=[stop], seed=11)
    for i, (prompt, out, ended) in enumerate(zip(PROMPTS, outs, stopped)):
        reference = lambda **stop_ids: reference_generate(  # noqa: E731
            model, prompt, 14, **kwargs, generator=torch.Generator().manual_seed(11 + i), **stop_ids
        )
        assert out.ids == reference()
        ids = ended.ids[:-1] if ended.stop == stop else ended.ids
        assert ids == reference(stop_ids=(stop,))


def test_cached_logits_equal_full_forward_at_every_step(model):
    torch.manual_seed(1)
    rows = [torch.randint(0, 300, (n,)).tolist() for n in (3, 8, 5)]
    longest = max(map(len, rows))
    cache = KVCache.for_model(model, len(rows), 30)
    padded = torch.tensor([r + [0] * (longest - len(r)) for r in rows])
    with torch.no_grad():
        prefill = model(padded, kv_cache=cache)
        cache.set_lengths([len(r) for r in rows])
        for b, r in enumerate(rows):
            torch.testing.assert_close(prefill[b, : len(r)], model(torch.tensor([r]))[0], rtol=0, atol=1e-4)
        # Decode with the rows at different lengths: each new token's logits equal the last
        # position of a full forward over that row's whole context.
        for step in range(10):
            new = [(7 * step + 13 * b) % 300 for b in range(len(rows))]
            rows = [r + [t] for r, t in zip(rows, new)]
            logits = model(torch.tensor(new)[:, None], kv_cache=cache)[:, -1]
            for b, r in enumerate(rows):
                torch.testing.assert_close(logits[b], model(torch.tensor([r]))[0, -1], rtol=0, atol=1e-4)
        assert cache.lengths == [len(r) for r in rows]
        # Several tokens at once after cached ones (equal lengths: the offset-causal mask path).
        cache.keep([1])
        more = [4, 8, 15, 16]
        logits = model(torch.tensor([more]), kv_cache=cache)[0]
        torch.testing.assert_close(logits, model(torch.tensor([rows[1] + more]))[0, -4:], rtol=0, atol=1e-4)


def test_cache_rejects_overflow_and_document_ids(model):
    cache = KVCache.for_model(model, 1, 4)
    with pytest.raises(ValueError, match="KV cache full"):
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="document_ids"):
        model(torch.zeros(1, 2, dtype=torch.long), document_ids=torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="max_len"):
        KVCache.for_model(model, 1, 41)


def test_batched_equals_unbatched(model):
    engine = Engine(model)
    batched = engine.generate(PROMPTS, 12, temperature=0)
    assert [o.ids for o in batched] == [engine.generate([p], 12, temperature=0)[0].ids for p in PROMPTS]
    # Each row samples from its own generator: with per-row seeds a row is the same alone or batched.
    seeds = [11, 12, 13, 14]
    sampled = engine.generate(PROMPTS, 12, temperature=1.0, top_k=40, seed=seeds)
    for prompt, seed, out in zip(PROMPTS, seeds, sampled):
        alone = engine.generate([prompt], 12, temperature=1.0, top_k=40, seed=seed)[0]
        assert alone.ids == out.ids
        torch.testing.assert_close(alone.logprobs, out.logprobs, rtol=0, atol=1e-5)


def test_logprobs_match_the_training_time_computation(model):
    temperature = 0.7
    outs = Engine(model).generate(PROMPTS, 10, temperature=temperature, top_p=0.8, repetition_penalty=1.2, seed=5)
    for prompt, out in zip(PROMPTS, outs):
        # What a trainer computes: one forward over prompt + completion, log-softmax at the
        # completion's positions.
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.ids]))[0, len(prompt) - 1 : -1]
        index = torch.tensor(out.ids)[:, None]
        expected = logits.log_softmax(-1).gather(1, index)[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, rtol=0, atol=1e-4)
        scaled = (logits / temperature).log_softmax(-1).gather(1, index)[:, 0]
        torch.testing.assert_close(torch.tensor(out.temperature_logprobs), scaled, rtol=0, atol=1e-4)
        # The distribution actually sampled from is narrower (top-p), so its log-probs are higher,
        # except for a token the repetition penalty pushed down (one already in the sequence).
        seen = set(prompt)
        for token, s, t in zip(out.ids, out.sampling_logprobs, out.temperature_logprobs):
            assert token in seen or s >= t - 1e-5, (token, s, t)
            seen.add(token)
        assert all(s <= 1e-6 for s in out.sampling_logprobs)
    # Without the penalty the claim holds for every token.
    for out in Engine(model).generate(PROMPTS, 10, temperature=temperature, top_p=0.8, seed=5):
        assert all(s >= t - 1e-5 for s, t in zip(out.sampling_logprobs, out.temperature_logprobs))
    greedy = Engine(model).generate(PROMPTS[:1], 5, temperature=0)[0]
    assert greedy.sampling_logprobs == [0.0] * 5 and greedy.temperature_logprobs == greedy.logprobs


def test_sampling_logits_match_transformers_processors():
    transformers = pytest.importorskip("transformers")
    gen = transformers.generation
    torch.manual_seed(3)
    logits = torch.randn(3, 50) * 3
    history = torch.randint(0, 50, (3, 12))
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, history, True)
    for params in (
        SamplingParams(0.7, 10, 0.9, 0.05, 1.3),
        SamplingParams(1.5, 0, 0.6, 0.0, 1.0),
        SamplingParams(0.5, 0, 1.0, 0.2, 0.8),
        SamplingParams(1.0, 3, 1.0, 0.0, 2.0),
    ):
        chain = [
            gen.RepetitionPenaltyLogitsProcessor(params.repetition_penalty),
            gen.TemperatureLogitsWarper(params.temperature),
        ]
        chain += [gen.TopKLogitsWarper(params.top_k)] if params.top_k else []
        chain += [gen.TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
        chain += [gen.MinPLogitsWarper(params.min_p)] if params.min_p > 0 else []
        expected = logits.clone()
        for processor in chain:
            expected = processor(history, expected)
        ours = sampling_logits(logits, params, seen)
        assert torch.equal(torch.isinf(ours), torch.isinf(expected))
        torch.testing.assert_close(ours.softmax(-1), expected.softmax(-1))


def test_crafted_filters():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, -3.0]]
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.25 keeps those >= 0.125
    probs = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(min_p_filter(probs, 0.25)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(min_p_filter(probs, 0.7)).tolist() == [[True, False, False, False]]
    kept = lambda p: torch.isfinite(sampling_logits(probs, p)).tolist()[0]  # noqa: E731
    assert kept(SamplingParams(top_k=2)) == [True, True, False, False]
    assert kept(SamplingParams(top_p=0.7)) == [True, True, False, False]
    # At temperature 2 the probabilities flatten, so the same min_p keeps more tokens.
    assert kept(SamplingParams(temperature=2.0, min_p=0.4)) == [True, True, True, False]


def test_engine_samples_only_inside_the_filtered_support(model):
    engine = Engine(model)
    with torch.no_grad():
        probs = model(torch.tensor([PROMPTS[0]]))[0, -1].softmax(-1)
    allowed = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    firsts = {engine.generate([PROMPTS[0]], 1, min_p=0.3, seed=s)[0].ids[0] for s in range(60)}
    assert firsts <= allowed and (len(allowed) == 1 or len(firsts) > 1)
    greedy = engine.generate(PROMPTS, 8, temperature=0)
    assert [o.ids for o in engine.generate(PROMPTS, 8, temperature=1.7, top_k=1, seed=0)] == [o.ids for o in greedy]
    # A strong penalty keeps greedy decoding off tokens it has already produced.
    penalised = engine.generate([[1]], 25, temperature=0, repetition_penalty=100.0)[0].ids
    assert len(set(penalised)) == len(penalised) and 1 not in penalised


def test_seeds_are_reproducible(model):
    engine = Engine(model)
    run = lambda seed: [o.ids for o in engine.generate(PROMPTS, 10, top_p=0.95, seed=seed)]  # noqa: E731
    assert run(7) == run(7)
    assert run(7) != run(8)
    torch.manual_seed(123)
    first = run(None)
    torch.manual_seed(123)
    assert run(None) == first


def test_stop_token_ids_end_each_row(model):
    engine = Engine(model)
    full = engine.generate(PROMPTS, 15, temperature=0)
    stop = full[1].ids[5]
    outs = engine.generate(PROMPTS, 15, temperature=0, stop_token_ids=[stop])
    for whole, out in zip(full, outs):
        if stop in whole.ids:
            cut = whole.ids.index(stop) + 1
            assert out.ids == whole.ids[:cut] and out.finish_reason == "stop" and out.stop == stop
            assert len(out.logprobs) == cut
        else:
            assert out.ids == whole.ids and out.finish_reason == "length" and out.stop is None


def test_stop_strings_and_text(byte_tokenizer):
    text = "hello world. bye"
    script = byte_tokenizer.encode(text)
    engine = Engine(Scripted(tiny_model(), script), byte_tokenizer)
    out = engine.generate([[0]], 30, temperature=0, stop_strings=["d. ", "zzz"])[0]
    assert (out.text, out.finish_reason, out.stop) == ("hello worl", "stop", "d. ")
    # ids run through the token that completed the stop string.
    assert byte_tokenizer.decode(out.ids).startswith("hello world. ") and not byte_tokenizer.decode(
        out.ids[:-1]
    ).startswith("hello world. ")
    engine.model.calls = 0
    plain = engine.generate([[0]], len(script), temperature=0)[0]
    assert (plain.text, plain.finish_reason, plain.ids) == (text, "length", script)
    # The stop token ends the request; it is in ids but not in text.
    engine.model.calls = 0
    ended = engine.generate([[0]], 30, temperature=0, stop_token_ids=[script[3]])[0]
    assert ended.ids == script[:4] and ended.text == byte_tokenizer.decode(script[:3])


def test_stream_never_splits_a_character(byte_tokenizer):
    text = "hé 你好🎉 ok"
    script = byte_tokenizer.encode(text)
    assert len(script) > len(text)  # multi-byte characters span several tokens
    engine = Engine(Scripted(tiny_model(), script), byte_tokenizer)
    events = list(engine.stream([0], len(script), temperature=0))
    assert [e.id for e in events] == script
    pieces = [e.text for e in events]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # A piece is released exactly when a character's last byte arrives: 你 is 3 bytes, 🎉 is 4.
    counts = [len(byte_tokenizer.decode(script[: i + 1]).rstrip("\ufffd")) for i in range(len(script))]
    assert [len(p) for p in pieces] == [b - a for a, b in zip([0] + counts, counts)]
    assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])


def test_stream_equals_generate(model, byte_tokenizer):
    engine = Engine(model, byte_tokenizer)
    kwargs = dict(temperature=0.9, top_k=30, seed=4, stop_strings=["ll"])
    events = list(engine.stream([5, 6, 7], 20, **kwargs))
    out = engine.generate([[5, 6, 7]], 20, **kwargs)[0]
    assert [e.id for e in events] == out.ids
    assert "".join(e.text for e in events) == out.text
    assert [e.logprob for e in events] == out.logprobs
    assert events[-1].finish_reason == out.finish_reason


def test_text_stream_holds_back_possible_stop_strings(byte_tokenizer):
    stream = TextStream(byte_tokenizer, stop_strings=["<end>"])
    out = [stream.push(t) for t in byte_tokenizer.encode("a<en")]
    assert "".join(p for p, _ in out) == "a"  # "<en" may begin "<end>"
    assert stream.push(byte_tokenizer.encode("x")[0]) == ("<enx", None)
    pieces = [stream.push(t) for t in byte_tokenizer.encode("b<end>c")]
    assert "".join(p for p, _ in pieces) == "b" and pieces[-1][1] is None and pieces[-2][1] == "<end>"
    assert stream.text == "a<enxb" and stream.finish() == "" and stream.stopped == "<end>"


def test_bad_requests_name_the_argument(model, byte_tokenizer):
    engine = Engine(model)
    cases = [
        (dict(prompts=[[1] * 40], max_new_tokens=2), "prompts"),
        (dict(prompts=[[]], max_new_tokens=2), "prompts"),
        (dict(prompts=[[300]], max_new_tokens=2), "prompts"),
        (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens"),
        (dict(prompts=[[1]], max_new_tokens=2, top_p=0.0), "top_p"),
        (dict(prompts=[[1]], max_new_tokens=2, temperature=-1), "temperature"),
        (dict(prompts=[[1]], max_new_tokens=2, min_p=1.5), "min_p"),
        (dict(prompts=[[1]], max_new_tokens=2, repetition_penalty=0), "repetition_penalty"),
        (dict(prompts=[[1]], max_new_tokens=2, stop_strings=["x"]), "stop_strings"),
        (dict(prompts=[[1], [2]], max_new_tokens=2, seed=[1]), "seed"),
    ]
    for kwargs, key in cases:
        with pytest.raises(ConfigError) as err:
            engine.generate(**kwargs)
        assert err.value.key == key
    text = Engine(model, byte_tokenizer).generate(["hello"], 3, temperature=0)[0]
    assert text.prompt_tokens == len(byte_tokenizer.encode("hello")) and len(text.ids) == 3
