"""Chunked prefill in the scheduler (prefill_chunk_tokens): a long prompt prefills a chunk per loop
iteration while the running rows decode between chunks, and every request still gets what the
engine gives it alone."""

import argparse

import httpx
import pytest
import torch
from kiln_testing.models import Gate
from kiln_testing.scheduling import collect, scheduler_model
from kiln_testing.serving import serving, tiny_checkpoint

from kiln.cli import main
from kiln.errors import ConfigError
from kiln.infer.config import SamplingParams
from kiln.infer.engine import Engine
from kiln.serve.app import create_app
from kiln.serve.cli import load_for_inference
from kiln.serve.prefix_cache import PrefixCache
from kiln.serve.requests import GenerationRequest, SchedulerError
from kiln.serve.scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 8
LONG = [(11 * i + 5) % 290 + 3 for i in range(30)]  # 30 tokens: chunks of 8, 8, 8 and 6
SHORT = [5, 17, 42]
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model():
    return scheduler_model(max_seq_len=64)


class Calls(torch.nn.Module):
    """The model, recording (batch, tokens) of every forward, and failing the forward numbered `fail`."""

    def __init__(self, inner, fail: int = 0):
        super().__init__()
        self.inner, self.cfg, self.fail, self.shapes = inner, inner.cfg, fail, []

    def forward(self, tokens, **kwargs):
        self.shapes.append(tuple(tokens.shape))
        if len(self.shapes) == self.fail:
            raise RuntimeError("simulated chunk failure")
        return self.inner(tokens, **kwargs)


def alone(model, prompt, n):
    return Engine(model).generate([prompt], n, temperature=0)[0].ids


def test_a_chunked_prompt_gets_the_tokens_and_logprobs_of_one_prefill(model, scheduler_for):
    def run(**kwargs):
        scheduler = scheduler_for(model, **kwargs)
        [handle] = scheduler.submit([GenerationRequest(LONG, 10, GREEDY, logprobs=3, prompt_logprobs=True)])
        return collect(handle), scheduler.stats

    (scores, events), stats = run(prefill_chunk_tokens=CHUNK)
    (whole_scores, whole_events), whole_stats = run()
    assert (stats["prefill_chunks"], stats["prefills"]) == (4, 1)
    assert (whole_stats["prefill_chunks"], whole_stats["prefills"]) == (0, 1)
    assert [e.id for e in events] == [e.id for e in whole_events] == alone(model, LONG, 10)
    assert [e.logprob for e in events] == pytest.approx([e.logprob for e in whole_events], abs=1e-5)
    assert [[i for i, _ in e.top] for e in events] == [[i for i, _ in e.top] for e in whole_events]
    assert len(scores.logprobs) == len(LONG) and scores.logprobs[0] is None
    assert scores.logprobs[1:] == pytest.approx(whole_scores.logprobs[1:], abs=1e-5)


def test_prompt_only_request_is_chunked_too(model, scheduler_for):
    scheduler = scheduler_for(model, prefill_chunk_tokens=CHUNK)
    [handle] = scheduler.submit([GenerationRequest(LONG, 0, prompt_logprobs=True)])
    scores, events = collect(handle)
    reference = model(torch.tensor([LONG]))[0].float().log_softmax(-1)
    assert events == [] and scheduler.stats["prefill_chunks"] == 4
    assert scores.logprobs[1:] == pytest.approx([reference[t - 1, LONG[t]].item() for t in range(1, 30)], abs=1e-5)


def test_running_rows_decode_between_the_chunks(model, scheduler_for):
    calls = Calls(model)
    gated = Gate(calls, hold=3)  # the short request's prefill and first decode, then it waits
    scheduler = scheduler_for(gated, prefill_chunk_tokens=CHUNK)
    [short] = scheduler.submit([GenerationRequest(SHORT, 20, GREEDY)])
    assert gated.reached.wait(30)
    [long] = scheduler.submit([GenerationRequest(LONG, 6, GREEDY)])
    gated.open.set()
    assert [e.id for e in collect(short)[1]] == alone(model, SHORT, 20)
    assert [e.id for e in collect(long)[1]] == alone(model, LONG, 6)
    chunks = [i for i, (b, t) in enumerate(calls.shapes) if b == 1 and t > 1][1:]  # after the short prefill
    assert [calls.shapes[i] for i in chunks] == [(1, 8), (1, 8), (1, 8), (1, 6)]
    for a, b in zip(chunks, chunks[1:]):  # the running row got a decode step between every two chunks
        assert (1, 1) in calls.shapes[a + 1 : b]
    assert calls.shapes[chunks[-1] + 1] == (2, 1)  # then the long prompt decodes in the running batch
    assert scheduler.stats["joined_running"] == 1


def test_short_prompts_behind_a_long_one_start_while_it_prefills(model, scheduler_for):
    calls = Calls(model)
    scheduler = scheduler_for(calls, prefill_chunk_tokens=CHUNK)
    long, short = scheduler.submit([GenerationRequest(LONG, 4, GREEDY), GenerationRequest(SHORT, 8, GREEDY)])
    assert [e.id for e in collect(short)[1]] == alone(model, SHORT, 8)
    assert [e.id for e in collect(long)[1]] == alone(model, LONG, 4)
    # The short prompt's prefill and first decode steps ran before the long prompt's last chunk.
    assert calls.shapes[:4] == [(1, 3), (1, 8), (1, 1), (1, 8)]
    assert scheduler.stats["max_rows"] == 2


def test_long_prompts_admitted_together_prefill_as_one_group(model, scheduler_for):
    calls = Calls(model)
    scheduler = scheduler_for(calls, prefill_chunk_tokens=CHUNK)
    prompts = [LONG, LONG[::-1][:12], LONG[5:]]  # 30, 12 and 25 tokens
    handles = scheduler.submit([GenerationRequest(p, 3, GREEDY) for p in prompts])
    for handle, prompt in zip(handles, prompts):
        assert [e.id for e in collect(handle)[1]] == alone(model, prompt, 3)
    # Chunk 2 ends the 12-token prompt (4 tokens, right-padded to 8), which leaves the group and
    # decodes; the other two go on together, and their last chunk (6 and 1 tokens) ends both.
    assert calls.shapes[:6] == [(3, 8), (3, 8), (1, 1), (2, 8), (1, 1), (2, 6)]
    assert scheduler.stats["prefill_chunks"] == 4 and scheduler.stats["prefills"] == 2


def test_a_long_prompt_waits_for_the_group_in_flight(model, scheduler_for):
    calls = Calls(model)
    gated = Gate(calls, hold=2)  # the group's second chunk waits
    scheduler = scheduler_for(gated, prefill_chunk_tokens=CHUNK, max_prefill_tokens=8)
    [first] = scheduler.submit([GenerationRequest(LONG, 3, GREEDY)])
    assert gated.reached.wait(30)
    [second] = scheduler.submit([GenerationRequest(LONG[::-1], 3, GREEDY)])
    gated.open.set()
    for handle, prompt in zip((first, second), (LONG, LONG[::-1])):
        assert [e.id for e in collect(handle)[1]] == alone(model, prompt, 3)
    assert calls.shapes[:4] == [(1, 8)] * 3 + [(1, 6)]  # the first prompt's chunks, none of the second's
    assert scheduler.stats["prefill_chunks"] == 8


def test_a_group_is_at_most_max_prefill_tokens_of_chunks(model, scheduler_for):
    calls = Calls(model)
    scheduler = scheduler_for(calls, prefill_chunk_tokens=CHUNK, max_prefill_tokens=2 * CHUNK)
    handles = scheduler.submit([GenerationRequest(LONG[i:], 2, GREEDY) for i in range(3)])
    for i, handle in enumerate(handles):
        assert [e.id for e in collect(handle)[1]] == alone(model, LONG[i:], 2)
    assert calls.shapes[0] == (2, 8)  # two rows of 8 tokens: the third prompt waits for the next group


def test_a_failed_chunk_of_a_group_prefills_each_request_again_alone(model, scheduler_for):
    calls = Calls(model, fail=2)  # the group's second chunk fails once
    scheduler = scheduler_for(calls, prefill_chunk_tokens=CHUNK)
    handles = scheduler.submit([GenerationRequest(LONG, 4, GREEDY), GenerationRequest(LONG[3:], 4, GREEDY)])
    for handle, prompt in zip(handles, (LONG, LONG[3:])):
        assert [e.id for e in collect(handle)[1]] == alone(model, prompt, 4)
    assert (scheduler.stats["failures"], scheduler.stats["row_failures"]) == (1, 0)
    assert calls.shapes[:3] == [(2, 8), (2, 8), (1, 8)]  # the failed one, then the first prompt alone


def test_a_chunk_that_fails_fails_that_request_alone(model, scheduler_for):
    calls = Calls(model, fail=4)  # short prefill, chunk 1, decode, chunk 2: fails
    scheduler = scheduler_for(calls, prefill_chunk_tokens=CHUNK)
    short, long = scheduler.submit([GenerationRequest(SHORT, 12, GREEDY), GenerationRequest(LONG, 5, GREEDY)])
    with pytest.raises(SchedulerError, match="simulated chunk failure"):
        collect(long)
    assert [e.id for e in collect(short)[1]] == alone(model, SHORT, 12)
    assert (scheduler.stats["failures"], scheduler.stats["row_failures"]) == (1, 1)
    [again] = scheduler.submit([GenerationRequest(LONG, 5, GREEDY)])
    assert [e.id for e in collect(again)[1]] == alone(model, LONG, 5)


def test_a_request_cancelled_mid_prefill_leaves(model, scheduler_for):
    calls = Calls(model)
    gated = Gate(calls, hold=2)  # the second chunk waits
    scheduler = scheduler_for(gated, prefill_chunk_tokens=CHUNK)
    [long] = scheduler.submit([GenerationRequest(LONG, 5, GREEDY)])
    assert gated.reached.wait(30)
    long.cancel()
    gated.open.set()
    [after] = scheduler.submit([GenerationRequest(SHORT, 4, GREEDY)])
    assert [e.id for e in collect(after)[1]] == alone(model, SHORT, 4)
    assert scheduler.stats["prefill_chunks"] == 2 and scheduler.stats["prefills"] == 1  # only `after` finished


def test_a_chunked_prompt_reuses_and_stores_cached_prefixes(model, scheduler_for):
    cache = PrefixCache(1 << 20, block=16)
    scheduler = scheduler_for(model, prefill_chunk_tokens=CHUNK, prefix_cache=cache)
    first = LONG[:20]
    [a] = scheduler.submit([GenerationRequest(first, 4, GREEDY)])
    assert [e.id for e in collect(a)[1]] == alone(model, first, 4)
    [b] = scheduler.submit([GenerationRequest(LONG, 4, GREEDY)])
    assert [e.id for e in collect(b)[1]] == alone(model, LONG, 4)
    # `first` prefilled in chunks 8, 8, 4 and stored 16 tokens; LONG reused them and chunked the other 14.
    assert cache.stats["tokens_reused"] == 16 and scheduler.stats["prefill_chunks"] == 3 + 2


def test_prefill_chunk_tokens_must_not_be_negative(model, tmp_path, capsys):
    with pytest.raises(ConfigError, match="prefill_chunk_tokens"):
        Scheduler(model, prefill_chunk_tokens=-1)
    assert main(["serve", str(tmp_path), "--prefill-chunk-tokens", "-1"]) == 2
    assert "--prefill-chunk-tokens: must be >= 0, got -1" in capsys.readouterr().err


def test_the_server_chunks_long_prompts(tmp_path):
    ckpt = tiny_checkpoint(tmp_path, tmp_path / "ckpt")
    args = argparse.Namespace(checkpoint=str(ckpt), tokenizer=None, device="cpu", dtype="auto")
    model, tokenizer = load_for_inference(args)
    app = create_app(model, tokenizer, prefill_chunk_tokens=4)
    with serving(app) as (base, _):
        body = {"model": "kiln", "prompt": "a prompt of more than four tokens", "max_tokens": 3, "temperature": 0}
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
        assert app.state.scheduler.stats["prefill_chunks"] >= 2
