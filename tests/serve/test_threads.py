"""kiln/serve/threads.py: the passing thread the model is loaded on."""

import threading

import pytest
from kiln_testing.serving import tiny_checkpoint

from kiln.errors import ConfigError
from kiln.infer.load import InferenceOptions, load_for_inference
from kiln.infer.quant import PackedLinear
from kiln.serve.threads import on_passing_thread


def test_on_passing_thread_returns_the_value_from_an_ended_thread_and_raises_its_errors():
    seen = []

    def work(x):
        seen.append(threading.current_thread())
        return x * 2

    assert on_passing_thread(work, 21) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def refuse():
        raise ConfigError("--prepack", "no", "<command line>")

    with pytest.raises(ConfigError, match="--prepack: no"):
        on_passing_thread(refuse)


def test_the_python_path_in_docs_serve_md_loads_off_thread_and_serves(tmp_path):
    """docs/serve.md "From Python": on_passing_thread(load_for_inference, ...) then create_app."""
    from fastapi.testclient import TestClient

    from kiln.serve.app import create_app

    checkpoint = tiny_checkpoint(tmp_path, tmp_path / "ckpt")
    loaders = []

    def load(*args):
        loaders.append(threading.current_thread())
        return load_for_inference(*args)

    opts = InferenceOptions(device="cpu", dtype="float32", prepack=True)
    model, tokenizer = on_passing_thread(load, str(checkpoint), None, opts)
    assert loaders[0] is not threading.current_thread()
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    with TestClient(create_app(model, tokenizer, model_name="tiny")) as client:
        body = {"model": "tiny", "prompt": "def f", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
