"""The chat page in a real headless Chromium (Playwright driving Debian's /usr/bin/chromium) against
the server on a tiny random checkpoint: conversations longer than the context, the API-key field,
code blocks, the note for a model without chat training, and the layout against a reference."""

import argparse
import json
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from kiln_testing.serving import free_port, serving, tiny_checkpoint, wait_until_healthy

from kiln.serve.app import create_app
from kiln.serve.cli import load_for_inference

KEY = "sk-kiln-browser"
CONTEXT = 128
# Boxes (x, y, width, height) at 900x640 measured in Debian Chromium; a hidden element is all zeros.
LAYOUT = Path(__file__).parent / "data" / "chat_layout.json"
TOLERANCE_PX = 12  # fonts differ between machines; a moved or missing element is off by far more


def _chromium():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    return sync_api, path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    return tiny_checkpoint(root, root / "ckpt", max_seq_len=CONTEXT)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    args = argparse.Namespace(checkpoint=str(checkpoint), tokenizer=None, device="cpu", dtype="auto")
    return load_for_inference(args)


@contextmanager
def kiln_serve(checkpoint):
    """`kiln serve CHECKPOINT` as its own process on a free port; yields the base URL."""
    port = free_port()
    command = [sys.executable, "-m", "kiln.serve.cli", "serve", str(checkpoint), "--port", str(port), "--device", "cpu"]
    command += ["--served-model-name", "tiny"]  # the header holds the name: a long path would wrap it
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, 60, process)  # torch's import and the model load
        yield base
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture(scope="module")
def browser():
    sync_api, path = _chromium()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def _page(browser, base, key=None):
    page = browser.new_page(viewport={"width": 900, "height": 640})
    page.goto(base + "/")
    if key:
        page.fill("#apikey", key)
        page.dispatch_event("#apikey", "change")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "256")  # the default; more than the context, so the page must cap it
    return page


def _turns(page, n):
    for i in range(n):
        page.fill("#input", f"Question number {i}: tell me about lists and tuples in Python, please.")
        page.press("#input", "Enter")
        page.wait_for_selector(f'.error, .assistant:nth-of-type({2 * i + 2})[data-state="done"]', timeout=60_000)
        assert page.query_selector(".error") is None, page.inner_text(".error")
    return page.eval_on_selector_all(".assistant", "es => es.map(e => e.textContent)")


def _layout(page):
    return page.evaluate(
        """() => Object.fromEntries(["header", "#note", "#log", "#form", "#keyfield", "#send"].map((s) => {
             const r = document.querySelector(s).getBoundingClientRect();
             return [s, [Math.round(r.x), Math.round(r.y), Math.round(r.width), Math.round(r.height)]];
           }))"""
    )


@pytest.mark.slow
def test_chat_page_in_chromium(checkpoint, loaded, browser, tmp_path):
    model, tok = loaded
    with kiln_serve(checkpoint) as base:  # a checkpoint outside any chat stage's folder: a base model
        page = _page(browser, base)
        assert not page.is_visible("#keyfield")  # no key required: no key box
        assert page.is_visible("#note")  # no chat training: the page says so
        # Two turns, then ten: the history outgrows the 128-token context and is trimmed, every
        # turn answered (a failed turn would leave an .error line).
        assert len(_turns(page, 2)) == 2
        page.click("#reset")
        texts = _turns(page, 10)
        assert page.query_selector(".error") is None
        assert len(texts) == 10 and all(texts), texts
        assert int(page.get_attribute("#log", "data-dropped")) > 0  # the oldest exchanges were dropped
        page.click("#reset")
        font = page.evaluate(
            "() => getComputedStyle(bubble('assistant', 'see ```py\\nx = [1, 2]\\n```').querySelector('pre')).fontFamily"
        )
        assert "monospace" in font
        page.click("#reset")
        page.screenshot(path=str(tmp_path / "chat_no_key.png"))
        layout = _layout(page)
    keyed = create_app(model, tok, model_name="tiny", api_keys=[KEY], chat_trained=True)
    with serving(keyed) as (base, _):
        page = _page(browser, base, key=KEY)
        assert page.is_visible("#keyfield") and not page.is_visible("#note")
        assert len(_turns(page, 2)) == 2 and page.query_selector(".error") is None
        page.click("#reset")
        page.screenshot(path=str(tmp_path / "chat_key.png"))
        keyed_layout = _layout(page)
    reference = json.loads(LAYOUT.read_text())
    for name, got in (("no_key", layout), ("key", keyed_layout)):
        for selector, box in reference[name].items():
            assert all(abs(a - b) <= TOLERANCE_PX for a, b in zip(got[selector], box)), (name, selector, got, box)


def test_failed_turn_leaves_no_empty_bubble(loaded, browser):
    model, tok = loaded
    with serving(create_app(model, tok, model_name="tiny", api_keys=[KEY])) as (base, _):
        page = _page(browser, base, key="wrong-key")
        page.fill("#input", "Hello")
        page.press("#input", "Enter")
        page.wait_for_selector(".error", timeout=60_000)
        assert "API key" in page.inner_text(".error")
        assert page.query_selector(".assistant") is None


def test_api_refuses_what_the_page_trims(loaded):
    """The trimming is the page's: the API answers an over-long conversation with the named 400."""
    model, tok = loaded
    long = [{"role": "user", "content": "tell me about lists and tuples in Python " * 4}] * 9
    with serving(create_app(model, tok, model_name="tiny")) as (base, _):
        counted = httpx.post(base + "/tokenize", json={"messages": long}).json()
        assert counted["count"] > counted["max_model_len"] == CONTEXT
        reply = httpx.post(base + "/v1/chat/completions", json={"messages": long, "max_tokens": 8})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages" and "this model's context is 128 tokens" in error["message"]
