"""The server driven by the official `openai` client (and raw HTTP for what a client library would
refuse to send), against a tiny random model saved and loaded as a real checkpoint."""

import argparse
import asyncio
import io
import json
import shutil
import statistics
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from kiln_testing.models import ForcesToken
from kiln_testing.serving import serving, tiny_checkpoint

from kiln.data.chat import ChatTokens, render_prompt
from kiln.infer.engine import Engine
from kiln.serve.app import create_app
from kiln.serve.cli import add_parser as add_serve_parsers
from kiln.serve.cli import load_for_inference, run_chat

KEY = "sk-kiln-test"
NAME = "tiny"
LIMIT = 100


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved checkpoint with its tokenizer.json beside it, as `kiln serve` finds them."""
    root = tmp_path_factory.mktemp("serve")
    return tiny_checkpoint(root, root / "ckpt")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    args = argparse.Namespace(checkpoint=str(checkpoint), tokenizer=None, device="cpu", dtype="auto")
    return load_for_inference(args)


@pytest.fixture(scope="module")
def server(loaded):
    model, tok = loaded
    app = create_app(
        model,
        tok,
        model_name=NAME,
        api_keys=[KEY],
        max_body_bytes=64 * 1024,
        max_tokens_limit=LIMIT,
        max_batch=32,
        max_waiting=64,
    )
    with serving(app) as (base, _):
        yield base, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def post(base, path, body, key=KEY, **kwargs):
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **kwargs.pop("headers", {})}
    content = body if isinstance(body, (bytes, str)) or hasattr(body, "__next__") else json.dumps(body)
    return httpx.post(base + path, content=content, headers=headers, timeout=60, **kwargs)


def still_healthy(base, client):
    assert httpx.get(base + "/health").json()["status"] == "ok"
    out = client.completions.create(model=NAME, prompt="ok", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_models_health_openapi(server, client):
    base, _ = server
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(base + "/health").json()["status"] == "ok"
    schema = httpx.get(base + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/tokenize"):
        assert path in schema["paths"]
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "max_tokens", "echo", "logprobs", "stream_options", "seed", "stop", "n"} <= set(props)


def test_completion_equals_engine_with_exact_usage(loaded, client):
    model, tok = loaded
    prompt = "def main():\n    return"
    ids = tok.encode(prompt)
    expected = Engine(model, tok).generate([ids], 12, temperature=0)[0]
    out = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        len(ids),
        12,
        len(ids) + 12,
    )
    # A stop string taken from the greedy text ends the completion just before it.
    stop = expected.text[3:6]
    cut = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == expected.text[: expected.text.index(stop)]
    assert cut.usage.completion_tokens < 12


def test_token_id_prompts_batched_with_n(loaded, client):
    model, tok = loaded
    prompts = [[5, 100, 200], [300, 301, 302, 303, 9]]
    out = client.completions.create(
        model=NAME, prompt=prompts, max_tokens=6, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    expected = Engine(model, tok).generate(prompts, 6, temperature=0)
    assert [c.text for c in out.choices] == [expected[0].text] * 2 + [expected[1].text] * 2
    assert out.usage.prompt_tokens == 8 and out.usage.completion_tokens == 24


def test_seeded_sampling_is_reproducible_and_choices_differ(client):
    kwargs = dict(
        model=NAME, prompt="import", max_tokens=16, temperature=1.0, n=3, seed=42, extra_body={"ignore_eos": True}
    )
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices]
    assert len(set(texts)) == 3  # choice i samples with seed + i


def stream_text(chunks):
    texts, finishes, usage_chunks, chunks = {}, {}, [], list(chunks)
    for chunk in chunks:
        if chunk.usage is not None:
            usage_chunks.append(chunk)
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes, usage_chunks, chunks


def test_streamed_completion_equals_non_streamed(client):
    kwargs = dict(model=NAME, prompt=["class Foo:", "x = ["], max_tokens=20, temperature=0, n=2)
    plain = client.completions.create(**kwargs)
    texts, finishes, usage_chunks, chunks = stream_text(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert texts == {c.index: c.text for c in plain.choices}
    assert finishes == {c.index: [c.finish_reason] for c in plain.choices}  # exactly one finish chunk per choice
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0] and chunks[-1].choices == []
    assert usage_chunks[0].usage == plain.usage
    no_usage = list(client.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in no_usage)


def test_chat_equals_engine_and_stream(loaded, client):
    model, tok = loaded
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another?"},
    ]
    prompt = render_prompt(tok, messages)
    expected = Engine(model, tok).generate([prompt], 15, temperature=0, stop_token_ids=ChatTokens(tok).stop)[0]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=15, temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(expected.ids))
    texts, finishes, usage_chunks, chunks = stream_text(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=15,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert texts == {0: expected.text} and finishes == {0: [expected.finish_reason]}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role in (None, "assistant") for c in chunks if c.choices)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert usage_chunks[0].usage == out.usage and chunks[-1].choices == []


def test_chat_stops_at_end_of_turn_and_reports_logprobs(loaded):
    model, tok = loaded
    end = ChatTokens(tok).end
    messages = [{"role": "user", "content": "Say something."}]
    prompt = render_prompt(tok, messages)
    at = len(prompt) + 5  # the 6th generated token is <|end|>
    app = create_app(ForcesToken(model, end, at), tok, model_name=NAME)
    with serving(app) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=30, temperature=0, logprobs=True, top_logprobs=3
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and out.usage.completion_tokens == 6
        assert "<|end|>" not in choice.message.content
        entries = choice.logprobs.content
        assert len(entries) == 5  # the <|end|> that closed the turn is not part of the message
        if "\ufffd" not in "".join(e.token for e in entries):  # no character split over tokens
            assert "".join(e.token for e in entries) == choice.message.content
        for e in entries:
            assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob  # greedy
            assert bytes(e.bytes).decode("utf-8") == e.token
        # Completions stop at <|endoftext|> the same way.
        app_eot = create_app(ForcesToken(model, tok.eot_id, 8), tok, model_name=NAME)
    with serving(app_eot) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=NAME, prompt=[[7, 8, 9]], max_tokens=30, temperature=0)
        # Positions 3..7 are free; the token at 8 is <|endoftext|>, counted as vLLM counts its EOS.
        assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 6
        assert "<|endoftext|>" not in out.choices[0].text


@torch.inference_mode()
def test_echo_logprobs_serve_lm_eval_loglikelihood(loaded, server):
    """lm-eval's local-completions scores a continuation with {prompt: token ids, max_tokens: 1,
    echo: true, logprobs: 1, temperature: 0} and reads token_logprobs[ctxlen:-1] and
    top_logprobs[ctxlen:-1] (is_greedy: each token's logprob equals the best top value)."""
    model, tok = loaded
    base, _ = server
    context, continuation = tok.encode("def add(a, b):\n"), tok.encode("    return a + b")
    ids = context + continuation
    payload = {
        "model": NAME,
        "prompt": [ids, ids[:4]],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    out = post(base, "/v1/completions", payload).json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    reference = model(torch.tensor([ids])).float().log_softmax(-1)[0]
    lp = choices[0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ctxlen = len(context)
    score = sum(lp["token_logprobs"][ctxlen:-1])
    expected = sum(reference[t - 1, ids[t]].item() for t in range(ctxlen, len(ids)))
    assert score == pytest.approx(expected, abs=1e-3)
    is_greedy = all(
        tok_lp == max(top.values())
        for tok_lp, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1])
    )
    assert is_greedy == all(reference[t - 1].argmax().item() == ids[t] for t in range(ctxlen, len(ids)))
    assert choices[0]["text"].startswith("def add(a, b):\n    return a + b")
    assert lp["text_offset"][:3] == [0, len(tok.decode(ids[:1])), len(tok.decode(ids[:2]))]
    assert out["usage"]["prompt_tokens"] == len(ids) + 4 and out["usage"]["completion_tokens"] == 2
    # max_tokens=0 with echo scores the prompt only.
    only = post(base, "/v1/completions", {**payload, "prompt": ids, "max_tokens": 0}).json()
    assert only["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
    assert only["usage"]["completion_tokens"] == 0
    # The remote-tokenizer endpoints lm-eval probes before using the server's tokenizer.
    info = httpx.get(base + "/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"]
    tokens = post(base, "/tokenize", {"prompt": "def add", "add_special_tokens": False}).json()["tokens"]
    assert tokens == tok.encode("def add")
    assert post(base, "/detokenize", {"tokens": tokens}).json()["prompt"] == "def add"


def test_auth(server):
    base, _ = server
    for key in ("sk-wrong", KEY[:-1], KEY + "x"):
        bad = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.completions.create(model=NAME, prompt="x", max_tokens=1)
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    no_key = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
    assert httpx.get(base + "/health").status_code == 200  # probes need no key
    assert httpx.get(base + "/").status_code == 200


def test_bad_requests_get_4xx_and_the_server_stays_healthy(server, client):
    base, _ = server

    def error(response, status):
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["message"]
        return body

    error(post(base, "/v1/completions", b'{"model": "tiny", "prompt": "x",'), 400)
    error(post(base, "/v1/chat/completions", b"\xff\xfe not json"), 400)
    assert (
        error(post(base, "/v1/completions", {"model": NAME, "prompt": "x", "temperature": "hot"}), 400)["param"]
        == "temperature"
    )
    assert error(post(base, "/v1/completions", {"model": NAME}), 400)["param"] == "prompt"
    huge = {"model": NAME, "prompt": "x" * 100_000}
    assert error(post(base, "/v1/completions", huge), 413)["code"] == "request_too_large"
    chunked = post(base, "/v1/completions", iter([json.dumps(huge).encode()]))  # no Content-Length
    assert error(chunked, 413)["code"] == "request_too_large"
    for body, param in (
        ({"prompt": "x", "max_tokens": LIMIT + 1}, "max_tokens"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": [], "max_tokens": 1}, "prompt"),
        ({"prompt": [[1, 2, 10**6]]}, "prompt"),
        ({"prompt": "x " * 200}, "prompt"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "n": 0}, "n"),
    ):
        assert error(post(base, "/v1/completions", {"model": NAME, **body}), 400)["param"] == param
    for body, param in (
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ):
        assert error(post(base, "/v1/chat/completions", {"model": NAME, **body}), 400)["param"] == param
    assert error(post(base, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404)["code"] == "model_not_found"
    error(httpx.get(base + "/v1/nowhere"), 404)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", max_tokens=1, logprobs=21)
    still_healthy(base, client)


class Slow(torch.nn.Module):
    """The model, slowed down so that a request is surely still running when its client leaves."""

    def __init__(self, inner, delay: float):
        super().__init__()
        self.inner, self.cfg, self.delay = inner, inner.cfg, delay

    def forward(self, tokens, **kwargs):
        time.sleep(self.delay)
        return self.inner(tokens, **kwargs)


def test_client_that_disconnects_frees_its_row(loaded):
    model, tok = loaded
    app = create_app(Slow(model, 0.02), tok, model_name=NAME)
    with serving(app) as (base, _):
        body = {"model": NAME, "prompt": "x", "max_tokens": 100, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: {")
                if events == 3:
                    break  # leaving the block closes the connection mid-stream
        scheduler = app.state.scheduler
        deadline = time.monotonic() + 30
        while scheduler.load != (0, 0):
            assert time.monotonic() < deadline, "the abandoned request kept running"
            time.sleep(0.02)
        assert scheduler.stats["tokens"] < 100
        assert httpx.get(base + "/health").json()["status"] == "ok"


def test_load_32_concurrent_streaming_clients(server):
    """No errors and exact token counts under load; prints throughput and latency percentiles."""
    base, app = server
    clients, tokens = 32, 24

    async def one(client, i):
        start = time.perf_counter()
        first, text, usage = None, "", None
        stream = await client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": f"Question number {i}?"}],
            max_tokens=tokens,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter() - start
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        return time.perf_counter() - start, first, usage

    async def main():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, i) for i in range(clients)))
        await client.close()
        return time.perf_counter() - start, results

    before = dict(app.state.scheduler.stats)
    wall, results = asyncio.run(main())
    assert all(usage.completion_tokens == tokens for _, _, usage in results)
    latencies = sorted(r[0] for r in results)
    ttft = sorted(r[1] for r in results if r[1] is not None)
    quantiles = statistics.quantiles(latencies, n=20)
    print(
        f"\nload: {clients} streaming clients x {tokens} tokens in {wall:.2f} s = "
        f"{clients * tokens / wall:.0f} tokens/s; latency p50 {statistics.median(latencies):.3f} s "
        f"p95 {quantiles[18]:.3f} s; first token p50 {statistics.median(ttft):.3f} s; "
        f"rows per step max {app.state.scheduler.stats['max_rows']}, "
        f"steps {app.state.scheduler.stats['steps'] - before['steps']}"
    )
    assert app.state.scheduler.stats["max_rows"] > 1  # requests shared decode steps


def test_kiln_chat_keeps_history(checkpoint, loaded):
    model, tok = loaded
    parser = argparse.ArgumentParser()
    add_serve_parsers(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(
        [
            "chat",
            str(checkpoint),
            "--temperature",
            "0",
            "--max-new-tokens",
            "10",
            "--system",
            "You are terse.",
            "--device",
            "cpu",
        ]
    )
    out, err = io.StringIO(), io.StringIO()
    assert (
        run_chat(args, stdin=io.StringIO("Hello there\n\nWhat next?\n/reset\nWhat next?\n"), stdout=out, stderr=err)
        == 0
    )
    engine, stop = Engine(model, tok), ChatTokens(tok).stop
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    first = engine.generate([render_prompt(tok, history)], 10, temperature=0, stop_token_ids=stop)[0].text
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "What next?"}]
    second = engine.generate([render_prompt(tok, history)], 10, temperature=0, stop_token_ids=stop)[0].text
    fresh = engine.generate([render_prompt(tok, [history[0], history[-1]])], 10, temperature=0, stop_token_ids=stop)[
        0
    ].text
    assert out.getvalue() == f"{first}\n{second}\n{fresh}\n"
    assert second != fresh  # the second turn saw the first exchange; after /reset it is gone
    # The same through a real pipe into the command.
    piped = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.serve.cli",
            "chat",
            str(checkpoint),
            "--temperature",
            "0",
            "--max-new-tokens",
            "10",
            "--system",
            "You are terse.",
            "--device",
            "cpu",
        ],
        input="Hello there\nWhat next?\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == f"{first}\n{second}\n"


def test_chat_page_is_self_contained(server):
    base, _ = server
    html = httpx.get(base + "/").text
    assert html.startswith("<!doctype html>") and '"tiny"' in html
    assert "http://" not in html and "https://" not in html and "<link" not in html and "src=" not in html


@pytest.mark.slow
def test_chat_page_streams_an_answer_in_chromium(server, client):
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH")
    base, _ = server
    question = "What is a list?"
    expected = (
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0
        )
        .choices[0]
        .message.content
    )
    assert len(expected) > 5
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(base + "/")
            page.fill("#apikey", KEY)
            page.dispatch_event("#apikey", "change")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "12")
            page.fill("#input", question)
            with page.expect_response("**/v1/chat/completions") as response:
                page.press("#input", "Enter")
            assert response.value.headers["content-type"].startswith("text/event-stream")
            page.wait_for_selector('.assistant[data-state="done"]', timeout=60_000)
            assert page.inner_text(".user") == question
            assert page.eval_on_selector(".assistant", "e => e.textContent") == expected
            # A second question is sent with the history: the answer equals the API's for the full conversation.
            follow = "And a tuple?"
            page.fill("#input", follow)
            page.click("#send")
            page.wait_for_selector('.assistant:nth-of-type(4)[data-state="done"]', timeout=60_000)
            history = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": expected},
                {"role": "user", "content": follow},
            ]
            again = (
                client.chat.completions.create(model=NAME, messages=history, max_tokens=12, temperature=0)
                .choices[0]
                .message.content
            )
            texts = page.eval_on_selector_all(".assistant", "es => es.map(e => e.textContent)")
            assert texts == [expected, again]
            assert page.query_selector(".error") is None
        finally:
            browser.close()
