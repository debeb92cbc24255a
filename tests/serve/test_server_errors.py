"""Requests that could break the server or their neighbours: non-finite numbers and lone surrogates
are refused with a 400 naming the field, a request that fails inside the running batch fails alone,
and the keep-alive connection a failed request came on serves the next request."""

import json
import threading

import httpx
import openai
import pytest
import torch
from kiln_testing.models import Gate
from kiln_testing.serving import serving

from kiln.model import ModelConfig, build_model
from kiln.serve import scheduler as scheduler_module
from kiln.serve.app import create_app

NAME = "tiny"
DOOMED_SEED = 666


@pytest.fixture(scope="module")
def gate(kiln_tokenizer):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=kiln_tokenizer.vocab_size, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64, init_std=0.2
    )
    gate = Gate(build_model(cfg).eval(), hold=0)
    gate.open.set()
    return gate


@pytest.fixture(scope="module")
def server(gate, kiln_tokenizer):
    app = create_app(gate, kiln_tokenizer, model_name=NAME)
    with serving(app) as (base, _):
        yield base, app


@pytest.fixture
def http(server):
    """One client, so one keep-alive connection for the requests of a test."""
    with httpx.Client(base_url=server[0], timeout=60) as client:
        yield client


def local_port(response: httpx.Response) -> int:
    """The client side's port of the connection the response came on."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def refused(http: httpx.Client, path: str, raw: str, param: str) -> int:
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"].startswith(param + ":"), error
    return local_port(response)


def answered_on(http: httpx.Client, port: int) -> None:
    """The next request on the connection works, and it came on that same connection."""
    response = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert local_port(response) == port


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", '{"prompt": "x", "temperature": NaN}', "temperature"),
        ("/v1/completions", '{"prompt": "x", "top_p": Infinity}', "top_p"),
        ("/v1/completions", '{"prompt": "x", "temperature": 1e999}', "temperature"),
        ("/v1/completions", '{"prompt": "x", "presence_penalty": -Infinity}', "presence_penalty"),
        ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": NaN}}', "logit_bias.5"),
        ("/v1/completions", '{"prompt": "x", "repetition_penalty": NaN}', "repetition_penalty"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "min_p": NaN}', "min_p"),
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"prompt": ["fine", "\\udc00"]}', "prompt.1"),
        ("/v1/completions", '{"prompt": "x", "stop": ["\\ud83d"]}', "stop.0"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
        (
            "/tokenize",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
            "messages.0.content.0.text",
        ),
        ("/detokenize", '{"tokens": [1, 2], "prompt": "\\ud800"}', "prompt"),
    ],
)
def test_refused_naming_the_field_and_the_connection_serves_on(http, path, raw, param):
    json.loads(raw)  # Python's parser takes each body: the server must refuse it itself
    port = refused(http, path, raw, param)
    answered_on(http, port)


def test_a_surrogate_pair_is_one_character_and_accepted(http):
    """Only a lone surrogate is refused: an escaped pair is an ordinary character (an emoji)."""
    response = http.post(
        "/tokenize", content='{"prompt": "\\ud83d\\ude00"}', headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 200 and response.json()["count"] >= 1


def test_an_unexpected_error_is_a_500_and_the_connection_serves_on(http, server, monkeypatch):
    tokenizer = server[1].state.serve.tokenizer

    def broken(text):
        raise RuntimeError("injected tokenizer failure")

    monkeypatch.setattr(tokenizer, "encode", broken)
    response = http.post("/tokenize", json={"prompt": "x"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "injected tokenizer failure" in error["message"]
    port = local_port(response)
    monkeypatch.undo()
    answered_on(http, port)


def stream_events(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_failing_request_leaves_the_stream_it_shares_the_batch_with_untouched(server, gate, monkeypatch):
    """The sampling of one request breaks (injected, so this holds whatever validation lets
    through) while it shares the batch, and its sampling call, with a greedy stream: the stream
    gets exactly the text it gets alone and the broken request a 500."""
    base, app = server
    greedy = {"prompt": "def main():", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    alone = stream_events(base, greedy)

    real = scheduler_module.sample_next_tokens

    def breaks_on_the_doomed_row(logits, params, seen, generators):
        if any(g.initial_seed() == DOOMED_SEED for g in generators):
            raise RuntimeError("injected sampling failure")
        return real(logits, params, seen, generators)

    monkeypatch.setattr(scheduler_module, "sample_next_tokens", breaks_on_the_doomed_row)
    scheduler = app.state.scheduler
    failures, joined = scheduler.stats["row_failures"], scheduler.stats["joined_running"]
    gate.calls, gate.hold = 0, 3  # the stream's second decode forward waits
    gate.open.clear()
    gate.reached.clear()
    shared: dict = {}
    stream = threading.Thread(target=lambda: shared.update(events=stream_events(base, greedy)))
    stream.start()
    try:
        assert gate.reached.wait(60)
        doomed = {"prompt": "class A:", "max_tokens": 10, "temperature": 0, "seed": DOOMED_SEED}
        request = threading.Thread(
            target=lambda: shared.update(doomed=httpx.post(base + "/v1/completions", json=doomed, timeout=60))
        )
        request.start()
        while scheduler.load[1] == 0 and request.is_alive():  # until it waits for the held batch
            threading.Event().wait(0.01)
    finally:
        gate.open.set()
    request.join(60)
    stream.join(60)
    assert shared["doomed"].status_code == 500
    assert "injected sampling failure" in shared["doomed"].json()["error"]["message"]
    assert scheduler.stats["joined_running"] == joined + 1 and scheduler.stats["row_failures"] == failures + 1
    assert all("error" not in event for event in shared["events"])
    assert [e["choices"] for e in shared["events"]] == [e["choices"] for e in alone]  # ids and times differ


def test_the_openai_client_still_works(server):
    """(The client itself refuses to send a NaN: httpx encodes JSON with allow_nan=False.)"""
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(model=NAME, prompt="def", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert chat.usage.completion_tokens >= 1
    streamed = client.completions.create(model=NAME, prompt="def", max_tokens=3, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
