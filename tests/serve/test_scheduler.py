import pytest
import torch
from kiln_testing.models import ForcesToken, Gate
from kiln_testing.scheduling import collect, scheduler_model

from kiln.errors import ConfigError
from kiln.infer.config import SamplingParams
from kiln.infer.engine import Engine, TextStream
from kiln.infer.kv_cache import KVCache
from kiln.serve import scheduler as scheduler_module
from kiln.serve.requests import Busy, GenerationRequest, SchedulerError, TokenEvent
from kiln.serve.scheduler import Scheduler

PROMPTS = [[5, 17, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [33, 2, 250, 7, 7]]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return scheduler_model(max_seq_len=48)


class Fails(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.cfg, self.armed = inner, inner.cfg, True

    def forward(self, tokens, **kwargs):
        if self.armed:
            self.armed = False
            raise RuntimeError("simulated device error")
        return self.inner(tokens, **kwargs)


@torch.inference_mode()
def test_extended_cache_decodes_like_one_prefilled_together(model):
    first, second = PROMPTS[:2], PROMPTS[2:]

    def prefill(prompts, max_len):
        cache = KVCache.for_model(model, len(prompts), max_len)
        tokens = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        logits = model(tokens, kv_cache=cache)
        cache.set_lengths([len(p) for p in prompts])
        return cache, logits[torch.arange(len(prompts)), torch.tensor([len(p) - 1 for p in prompts])]

    joint, joint_logits = prefill(PROMPTS, 30)
    cache, logits_a = prefill(first, 20)
    other, logits_b = prefill(second, 30)
    cache.extend(other)
    assert cache.max_len == 30 and cache.lengths == [len(p) for p in PROMPTS]
    logits = torch.cat([logits_a, logits_b])
    torch.testing.assert_close(logits, joint_logits, atol=1e-5, rtol=1e-5)
    for _ in range(6):
        step = logits.argmax(-1)[:, None]
        logits = model(step, kv_cache=cache)[:, -1]
        joint_logits = model(step, kv_cache=joint)[:, -1]
        torch.testing.assert_close(logits, joint_logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="differ"):
        cache.extend(KVCache(1, 1, 4, 30, 8))


def test_each_request_gets_what_the_engine_gives_it_alone(model, byte_tokenizer, scheduler_for):
    """Mixed sampling parameters in one batch; each request equals Engine.stream on its own."""
    cases = [
        (PROMPTS[0], 12, SamplingParams(temperature=0), {}),
        (PROMPTS[1], 9, SamplingParams(temperature=0.8, top_p=0.9), {"seed": 3}),
        (PROMPTS[2], 15, SamplingParams(temperature=1.2, top_k=20), {"seed": 7}),
        (PROMPTS[3], 10, SamplingParams(temperature=0, repetition_penalty=1.3), {}),
        (PROMPTS[1], 20, SamplingParams(temperature=0.7, min_p=0.05), {"seed": 11, "stop_strings": ["o"]}),
    ]
    scheduler = scheduler_for(model, byte_tokenizer, max_batch=8)
    requests = [GenerationRequest(list(p), n, params, stop_token_ids=(0,), **kw) for p, n, params, kw in cases]
    handles = scheduler.submit(requests)
    engine = Engine(model, byte_tokenizer)
    for (prompt, n, params, kw), handle in zip(cases, handles):
        _, events = collect(handle)
        expected = list(
            engine.stream(
                prompt,
                n,
                params.temperature,
                params.top_k,
                params.top_p,
                params.min_p,
                params.repetition_penalty,
                stop_token_ids=(0,),
                **kw,
            )
        )
        assert [e.id for e in events] == [t.id for t in expected]
        assert [e.text for e in events] == [t.text for t in expected]
        assert [e.finish_reason for e in events] == [t.finish_reason for t in expected]
        assert [e.logprob for e in events] == pytest.approx([t.logprob for t in expected], abs=1e-4)
    assert scheduler.stats["max_rows"] == len(cases)  # they really ran as one batch


def test_new_requests_join_the_running_batch(model, scheduler_for):
    gated = Gate(model, hold=4)  # prefill, then decode calls 2, 3: the 4th waits
    scheduler = scheduler_for(gated, max_batch=4)
    [long] = scheduler.submit([GenerationRequest(PROMPTS[1], 30, SamplingParams(temperature=0))])
    assert gated.reached.wait(30)
    assert scheduler.stats["steps"] == 3  # three tokens of `long` sampled; it is mid-generation
    [short] = scheduler.submit([GenerationRequest(PROMPTS[3], 5, SamplingParams(temperature=0))])
    gated.open.set()
    short_events, long_events = collect(short)[1], collect(long)[1]
    # The short request ran in the same batch as the long one instead of waiting for it to drain.
    assert scheduler.stats["joined_running"] == 1 and scheduler.stats["max_rows"] == 2
    assert scheduler.stats["steps"] == 30  # 30 decode steps in all: the 5 of `short` were shared
    outs = Engine(model).generate([PROMPTS[1], PROMPTS[3]], 30, temperature=0)
    assert [e.id for e in long_events] == outs[0].ids
    assert [e.id for e in short_events] == outs[1].ids[:5]


def test_joining_rows_leave_running_rows_unchanged(model, scheduler_for):
    gated = Gate(model, hold=6)
    scheduler = scheduler_for(gated, max_batch=4)
    [first] = scheduler.submit([GenerationRequest(PROMPTS[0], 25, SamplingParams(temperature=0))])
    assert gated.reached.wait(30)
    late = scheduler.submit([GenerationRequest(p, 12, SamplingParams(temperature=0)) for p in PROMPTS[1:]])
    gated.open.set()
    outs = Engine(model).generate(PROMPTS, 25, temperature=0)
    assert [e.id for e in collect(first)[1]] == outs[0].ids
    for handle, out in zip(late, outs[1:]):
        assert [e.id for e in collect(handle)[1]] == out.ids[:12]
    assert scheduler.stats["joined_running"] == 3


def test_stop_token_and_length(model, scheduler_for):
    # A stop token the model's own greedy continuation never picks, so only the forced one stops it.
    [plain] = scheduler_for(model).submit([GenerationRequest(PROMPTS[0], 20, SamplingParams(temperature=0))])
    end = min(set(range(model.cfg.vocab_size)) - {e.id for e in collect(plain)[1]})
    scheduler = scheduler_for(ForcesToken(model, end, at=10))
    handles = scheduler.submit(
        [
            GenerationRequest(PROMPTS[0], 20, SamplingParams(temperature=0), stop_token_ids=[end]),
            GenerationRequest(PROMPTS[0], 4, SamplingParams(temperature=0), stop_token_ids=[end]),
            GenerationRequest(PROMPTS[0], 20, SamplingParams(temperature=0)),
        ]
    )
    stopped, short, ignoring = (collect(h)[1] for h in handles)
    # Prompt of 3 tokens: positions 3..9 are free, the token at position 10 is the stop token.
    assert len(stopped) == 8 and stopped[-1].id == end and stopped[-1].finish_reason == "stop"
    assert [e.finish_reason for e in short] == [None, None, None, "length"]
    assert len(ignoring) == 20 and ignoring[-1].finish_reason == "length"


def test_context_limit_ends_with_length(model, scheduler_for):
    scheduler = scheduler_for(model)
    [handle] = scheduler.submit([GenerationRequest(PROMPTS[1], 100, SamplingParams(temperature=0))])
    events = collect(handle)[1]
    assert len(PROMPTS[1]) + len(events) == model.cfg.max_seq_len and events[-1].finish_reason == "length"


@torch.inference_mode()
def test_prompt_and_top_logprobs(model, scheduler_for):
    scheduler = scheduler_for(model)
    prompt = PROMPTS[3]
    handles = scheduler.submit(
        [
            GenerationRequest(prompt, 3, SamplingParams(temperature=0), logprobs=4, prompt_logprobs=True),
            GenerationRequest(prompt, 0, logprobs=0, prompt_logprobs=True),
        ]
    )
    scores, events = collect(handles[0])
    reference = model(torch.tensor([prompt + [e.id for e in events[:-1]]]))[0].float().log_softmax(-1)
    assert scores.logprobs[0] is None and scores.top[0] is None
    for t in range(1, len(prompt)):
        assert scores.logprobs[t] == pytest.approx(reference[t - 1, prompt[t]].item(), abs=1e-4)
        assert [i for i, _ in scores.top[t]] == reference[t - 1].topk(4).indices.tolist()
    for k, event in enumerate(events):
        row = reference[len(prompt) - 1 + k]
        assert event.logprob == pytest.approx(row[event.id].item(), abs=1e-4)
        assert [i for i, _ in event.top] == row.topk(4).indices.tolist()
        assert event.top[0] == (event.id, event.logprob)  # greedy: the chosen token is the best, exactly
    only, none = collect(handles[1])
    assert none == [] and only.logprobs[1:] == pytest.approx(scores.logprobs[1:], abs=1e-5)
    assert only.top[1:] == [[]] * (len(prompt) - 1)


def test_cancelled_request_leaves_and_others_continue(model, scheduler_for):
    gated = Gate(model, hold=3)
    scheduler = scheduler_for(gated)
    doomed, kept = scheduler.submit(
        [
            GenerationRequest(PROMPTS[0], 40, SamplingParams(temperature=0)),
            GenerationRequest(PROMPTS[2], 20, SamplingParams(temperature=0)),
        ]
    )
    assert gated.reached.wait(30)
    doomed.cancel()
    gated.open.set()
    events = collect(kept)[1]
    assert [e.id for e in events] == Engine(model).generate([PROMPTS[2]], 20, temperature=0)[0].ids
    assert scheduler.stats["tokens"] < 40 + 20  # the cancelled row stopped costing steps


def test_bad_requests_busy_and_failures(model, scheduler_for):
    gated = Gate(model, hold=2)
    scheduler = scheduler_for(gated, max_batch=1, max_waiting=1)
    for request, key in (
        (GenerationRequest([], 3), "prompt"),
        (GenerationRequest([1] * 48, 3), "prompt"),
        (GenerationRequest([1], 3, logprobs=21), "logprobs"),
        (GenerationRequest([400], 3), "prompt"),
        (GenerationRequest([1], 3, SamplingParams(top_p=0)), "top_p"),
        (GenerationRequest([1], -1), "max_tokens"),
        (GenerationRequest([1], 3, stop_strings=["x"]), "stop"),
    ):
        with pytest.raises(ConfigError) as err:
            scheduler.submit([request])
        assert err.value.key == key
    running = scheduler.submit([GenerationRequest(PROMPTS[0], 10, SamplingParams(temperature=0))])
    assert gated.reached.wait(30)
    waiting = scheduler.submit([GenerationRequest(PROMPTS[1], 3, SamplingParams(temperature=0))])
    with pytest.raises(Busy):
        scheduler.submit([GenerationRequest(PROMPTS[2], 3)])
    gated.open.set()
    assert len(collect(running[0])[1]) == 10 and len(collect(waiting[0])[1]) == 3

    broken = Fails(model)
    scheduler = scheduler_for(broken)
    [handle] = scheduler.submit([GenerationRequest(PROMPTS[0], 5, SamplingParams(temperature=0))])
    with pytest.raises(SchedulerError, match="simulated device error"):
        collect(handle)
    [handle] = scheduler.submit([GenerationRequest(PROMPTS[0], 5, SamplingParams(temperature=0))])
    assert len(collect(handle)[1]) == 5 and scheduler.alive and scheduler.stats["failures"] == 1


def test_events_reach_an_asyncio_consumer(model, scheduler_for):
    import asyncio

    scheduler = scheduler_for(model)

    async def main():
        [handle] = scheduler.submit(
            [GenerationRequest(PROMPTS[0], 6, SamplingParams(temperature=0))], loop=asyncio.get_running_loop()
        )
        return [event async for event in handle]

    events = asyncio.run(main())
    assert all(isinstance(e, TokenEvent) for e in events)
    assert [e.id for e in events] == Engine(model).generate([PROMPTS[0]], 6, temperature=0)[0].ids


DOOMED_SEED = 666  # the request the tests break on purpose draws from a generator with this seed


def ids_alone(model, tokenizer, request):
    """The tokens the scheduler gives request when it runs on its own."""
    scheduler = Scheduler(model, tokenizer)
    try:
        return [e.id for e in collect(scheduler.submit([request])[0])[1]]
    finally:
        scheduler.close()


def healthy_requests():
    """A greedy row and a seeded sampled one, with the doomed request's sampling parameters."""
    return [
        GenerationRequest(PROMPTS[0], 12, SamplingParams(temperature=0), stop_token_ids=(0,)),
        GenerationRequest(PROMPTS[1], 12, SamplingParams(temperature=0.8, top_p=0.9), seed=3),
    ]


def assert_only_the_doomed_one_failed(model, tokenizer, scheduler, healthy, doomed, match):
    handles = scheduler.submit([healthy[0], doomed, healthy[1]])
    with pytest.raises(SchedulerError, match=match):
        collect(handles[1])
    for request, handle in zip(healthy, (handles[0], handles[2])):
        assert [e.id for e in collect(handle)[1]] == ids_alone(model, tokenizer, request)
    assert scheduler.stats["row_failures"] == 1 and scheduler.alive


def test_a_row_whose_sampling_fails_fails_alone(model, scheduler_for, monkeypatch):
    """The doomed row shares its sampling call with a seeded row, and the failure comes after every
    generator of the call has drawn: the seeded row still draws exactly what it draws alone."""
    real = scheduler_module.sample_next_tokens

    def breaks_on_the_doomed_row(logits, params, seen, generators):
        out = real(logits, params, seen, generators)
        if any(g.initial_seed() == DOOMED_SEED for g in generators):
            raise RuntimeError("injected sampling failure")
        return out

    healthy = healthy_requests()
    for params in (healthy[0].params, healthy[1].params):
        doomed = GenerationRequest(PROMPTS[2], 12, params, seed=DOOMED_SEED)
        scheduler = scheduler_for(model, max_batch=8)
        monkeypatch.setattr(scheduler_module, "sample_next_tokens", breaks_on_the_doomed_row)
        assert_only_the_doomed_one_failed(model, None, scheduler, healthy, doomed, "injected sampling failure")
        monkeypatch.setattr(scheduler_module, "sample_next_tokens", real)  # ids_alone runs unbroken


def test_a_nan_temperature_is_refused_and_fails_alone_if_it_slips_through(model, scheduler_for, monkeypatch):
    scheduler = scheduler_for(model, max_batch=8)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        with pytest.raises(ConfigError) as err:
            scheduler.submit([GenerationRequest(PROMPTS[0], 3, SamplingParams(**{name: float("nan")}))])
        assert err.value.key == name and "nan" in err.value.message
    monkeypatch.setattr(scheduler, "check", lambda request: None)
    doomed = GenerationRequest(PROMPTS[2], 12, SamplingParams(temperature=float("nan")), seed=DOOMED_SEED)
    assert_only_the_doomed_one_failed(model, None, scheduler, healthy_requests(), doomed, "generation failed")


def test_a_row_whose_text_fails_fails_alone(model, byte_tokenizer, scheduler_for, monkeypatch):
    real = TextStream.push

    def breaks_on_boom(self, token):
        if "boom" in self.stop_strings:
            raise ValueError("injected detokenizer failure")
        return real(self, token)

    monkeypatch.setattr(TextStream, "push", breaks_on_boom)
    scheduler = scheduler_for(model, byte_tokenizer, max_batch=8)
    doomed = GenerationRequest(PROMPTS[2], 12, SamplingParams(temperature=0), [0], ["boom"])
    healthy = healthy_requests()
    assert_only_the_doomed_one_failed(model, byte_tokenizer, scheduler, healthy, doomed, "injected detokenizer")


class FailsOnToken(torch.nn.Module):
    """The model, but a forward whose tokens include `token` raises: a prompt that cannot run."""

    def __init__(self, inner, token: int):
        super().__init__()
        self.inner, self.cfg, self.token = inner, inner.cfg, token

    def forward(self, tokens, **kwargs):
        if (tokens == self.token).any():
            raise RuntimeError("injected prefill failure")
        return self.inner(tokens, **kwargs)


def test_a_prompt_whose_prefill_fails_fails_alone(model, scheduler_for):
    """The three prompts prefill in one forward, which fails; each again alone, only one fails."""
    scheduler = scheduler_for(FailsOnToken(model, 299), max_batch=8)
    doomed = GenerationRequest([7, 299, 3], 12, SamplingParams(temperature=0))
    assert_only_the_doomed_one_failed(model, None, scheduler, healthy_requests(), doomed, "injected prefill failure")
    assert scheduler.stats["prefills"] == 2 and scheduler.stats["failures"] == 2
