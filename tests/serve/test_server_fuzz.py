"""Schemathesis against the server's own OpenAPI schema (in-process, over ASGI), and hostile
path-like request fields: every request gets an answer below 500 that matches the schema where one
is declared, the server stays healthy afterwards, and no request reaches a file outside the model
folder."""

import argparse
import os
import shutil
import socket
import sys
from urllib.parse import quote

import httpx
import pytest
import torch

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
uvicorn = pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given  # noqa: E402
from kiln_testing.fuzz import fuzz_examples, fuzz_settings  # noqa: E402
from kiln_testing.serving import serving  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.python import asgi as st_asgi  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    response_schema_conformance,
    status_code_conformance,
)

from kiln.checkpoint import save_weights  # noqa: E402
from kiln.model import ModelConfig, build_model  # noqa: E402
from kiln.serve.app import create_app  # noqa: E402
from kiln.serve.cli import load_for_inference  # noqa: E402

KEY = "sk-fuzz"
NAME = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
OPERATIONS = {
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("GET", "/tokenizer_info"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
}
# Fuzzing budget per operation and mode: enough to reach every field, small enough for the default run.
EXAMPLES = fuzz_examples(25)
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, kiln_tokenizer):
    """A checkpoint folder (weights + tokenizer.json) inside `root`; `root/outside` sits next to it
    and holds the files a hostile request would go after."""
    root = tmp_path_factory.mktemp("fuzz-serve")
    torch.manual_seed(0)
    vocab = kiln_tokenizer.vocab_size
    cfg = ModelConfig(vocab_size=vocab, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64, init_std=0.2)
    save_weights(root / "model", cfg, build_model(cfg).state_dict(), {"step": 0})
    shutil.copy(kiln_tokenizer.path, root / "model" / "tokenizer.json")
    outside = root / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for clients\n")
    return root / "model"


@pytest.fixture(scope="module")
def loaded(model_dir):
    args = argparse.Namespace(checkpoint=str(model_dir), tokenizer=None, device="cpu", dtype="auto")
    return load_for_inference(args)


def make_app(loaded, **kwargs):
    model, tok = loaded
    return create_app(
        model,
        tok,
        model_name=NAME,
        api_keys=[KEY],
        max_body_bytes=16 * 1024,
        max_tokens_limit=24,
        max_batch=8,
        max_waiting=16,
        **kwargs,
    )


@pytest.fixture(scope="module")
def schema(loaded):
    app = make_app(loaded)
    loaded_schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    yield loaded_schema
    # Schemathesis starts the app's lifespan (the scheduler thread) once and keeps it for the process.
    st_asgi.shutdown_lifespans()


def call(case):
    return case.call_and_validate(headers=AUTH, checks=CHECKS, timeout=60)


def test_schema_lists_every_operation(schema):
    found = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert found == OPERATIONS
    # Error answers are declared with their body, so status_code_conformance and
    # response_schema_conformance hold the server to them.
    raw = schema.raw_schema
    for method, path in OPERATIONS - {("GET", "/health")}:
        responses = raw["paths"][path][method.lower()]["responses"]
        for status in ("400", "401", "404", "413", "429", "500", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse"), (path, status)


# Negative cases (bodies that break the schema) exist only where there is a body to break.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in sorted(OPERATIONS)] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in sorted(OPERATIONS) if m == "POST"
]


@pytest.mark.parametrize("method,path,mode", CASES, ids=lambda v: getattr(v, "value", v))
def test_no_server_errors(schema, method, path, mode):
    fuzz_operation(schema, method, path, mode, EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("method,path,mode", [c for c in CASES if c[0] == "POST"], ids=lambda v: getattr(v, "value", v))
def test_no_server_errors_heavy(schema, method, path, mode):
    fuzz_operation(schema, method, path, mode, EXAMPLES * 8)


def fuzz_operation(schema, method, path, mode, examples):
    operation = schema[path][method]

    @fuzz_settings(examples, HealthCheck)
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        call(case)

    fuzz()
    # The run above must leave a serving server: it answers /health and still generates.
    with st_asgi.get_client(schema.app) as client:
        assert client.get("/health").json()["status"] == "ok"
        out = client.post("/v1/completions", json={"prompt": "def", "max_tokens": 2, "temperature": 0}, headers=AUTH)
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["completion_tokens"] >= 1


# ---- regressions the fuzzer found (each was a 500) ---------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_out_of_range_is_a_400(schema, seed):
    with st_asgi.get_client(schema.app) as client:
        for path, body in (
            ("/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": seed, "n": 2}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "seed": seed, "n": 2},
            ),
        ):
            out = client.post(path, json=body, headers=AUTH)
            assert out.status_code == 400, out.text
            assert out.json()["error"]["param"] == "seed"
        # The extremes of the accepted range work, including seed + i for the second choice.
        for seed in (2**63 - 1, -(2**63)):
            out = client.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 1, "seed": seed, "n": 2}, headers=AUTH
            )
            assert out.status_code == 200, out.text
        assert client.get("/health").json()["status"] == "ok"


def test_extreme_sampling_values_do_not_fail_the_batch(schema):
    """Sampling values that overflow float32 logits once made the scheduler step raise, which
    answered 500 to that request and to every other one decoding in the same batch."""
    with st_asgi.get_client(schema.app) as client:

        def complete(**extra):
            body = {"prompt": "def f", "max_tokens": 5, "ignore_eos": True, "seed": 3, **extra}
            return client.post("/v1/completions", json=body, headers=AUTH)

        greedy = complete(temperature=0)
        assert greedy.status_code == 200, greedy.text
        for extra in (
            {"temperature": 1e-300},
            {"temperature": 5e-324},
            {"top_p": 1e-300},
            {"top_p": 5e-324, "temperature": 0.7},
        ):
            out = complete(**extra)
            assert out.status_code == 200, (extra, out.text)
            # Such a temperature, or a top_p below any one token's probability, is greedy decoding.
            assert out.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"], extra
        for value in (1e-300, 1e300, 0.0, -1.0):
            out = complete(repetition_penalty=value)
            assert out.status_code == 400, out.text
            assert out.json()["error"]["param"] == "repetition_penalty"
        out = client.post(
            "/v1/chat/completions",
            headers=AUTH,
            json={
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 3,
                "temperature": 1e-300,
                "top_p": 1e-300,
                "repetition_penalty": 1e-6,
            },
        )
        assert out.status_code == 200, out.text
        assert client.get("/health").json()["status"] == "ok"


def test_sampling_fields_never_fail(schema):
    """Hypothesis over the numeric sampling fields alone, with floats from subnormal to huge (which
    schemathesis's JSON generation rarely reaches): every combination is answered below 500."""
    from hypothesis import strategies as st

    def number(low, high):
        # Mostly inside the accepted range (an out-of-range field makes the whole body a 400 and
        # hides the others), with the extremes float32 cannot hold; sometimes anything at all.
        edges = st.sampled_from([5e-324, 1e-300, 1e-40, 1e-8, 1e300])
        return (
            st.floats(low, high)
            | edges.filter(lambda v: low <= v <= high)
            | st.floats(allow_nan=False, allow_infinity=False)
        )

    fields = st.fixed_dictionaries(
        {},
        optional={
            "temperature": number(0, 2),
            "top_p": number(0, 1),
            "min_p": number(0, 1),
            "repetition_penalty": number(1e-6, 1e6),
            "top_k": st.integers(-1, 10**6),
            "seed": st.integers(-(2**63), 2**63 - 1) | st.integers(-(2**65), 2**65),
            "n": st.integers(1, 3),
            "logprobs": st.integers(-1, 21),
        },
    )

    with st_asgi.get_client(schema.app) as client:

        @fuzz_settings(EXAMPLES * 2, HealthCheck)
        @given(extra=fields)
        def fuzz(extra):
            body = {"prompt": "def f", "max_tokens": 3, **extra}
            out = client.post("/v1/completions", json=body, headers=AUTH)
            assert out.status_code < 500, (body, out.text)
            assert out.status_code in (200, 400), (body, out.text)

        fuzz()
        assert client.get("/health").json()["status"] == "ok"


# ---- path safety ---------------------------------------------------------------------------------

HOSTILE_NAMES = [
    "../../etc/passwd",
    "/etc/passwd",
    "..%2F..%2Fetc%2Fpasswd",
    "%2e%2e/%2e%2e/etc/passwd",
    "....//....//etc/passwd",
    "..\\..\\windows\\win.ini",
    "file:///etc/passwd",
    "~/.ssh/id_rsa",
    "tiny/../../outside/secret.txt",
    "../outside/secret.txt",
    "tiny\x00../../etc/passwd",
    "",
]


class FileWatch:
    """Records every file the process opens, lists, stats for change, renames or removes while
    active (Python audit events, so the server's threads are seen too)."""

    EVENTS = {
        "open",
        "os.listdir",
        "os.scandir",
        "os.remove",
        "os.rename",
        "os.mkdir",
        "os.rmdir",
        "os.chmod",
        "os.truncate",
        "shutil.rmtree",
        "shutil.copyfile",
        "os.symlink",
        "os.link",
        "glob.glob",
    }

    def __init__(self):
        self.active = False
        self.seen: list[tuple[str, str]] = []
        sys.addaudithook(self._hook)  # cannot be removed; inert while not active

    def _hook(self, event, args):
        if self.active and event in self.EVENTS and args:
            target = args[0]
            if isinstance(target, (str, bytes, os.PathLike)):
                self.seen.append((event, os.fsdecode(target)))


@pytest.fixture(scope="module")
def watched_server(loaded):
    watch = FileWatch()
    with serving(make_app(loaded)) as (base, port):
        yield base, port, watch


def raw_get(port: int, target: str) -> tuple[int, bytes]:
    """GET with the request target sent as is: clients such as httpx normalise `..` away."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode(
                "latin-1"
            )
        )
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data


def test_hostile_model_names_get_404_and_touch_nothing(watched_server, model_dir):
    base, port, watch = watched_server
    outside = model_dir.parent / "outside"
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in outside.iterdir()}
    listing = sorted(p.name for p in model_dir.parent.iterdir())
    watch.active = True
    (outside / "secret.txt").read_bytes()  # the watch sees this test's own read...
    assert watch.seen and watch.seen[-1][1] == str(outside / "secret.txt")
    watch.seen.clear()  # ...and from here on only the server's
    try:
        for name in HOSTILE_NAMES + [str(model_dir), str(outside / "secret.txt"), quote(str(model_dir), safe="")]:
            for path, body in (
                ("/v1/completions", {"model": name, "prompt": "x", "max_tokens": 1}),
                (
                    "/v1/chat/completions",
                    {"model": name, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
                ),
            ):
                out = httpx.post(base + path, json=body, headers=AUTH, timeout=60)
                assert out.status_code == 404, (name, out.text)
                error = out.json()["error"]
                assert error["code"] == "model_not_found" and error["param"] == "model"
                assert "not for clients" not in out.text
        for target in (
            "/../../etc/passwd",
            "/v1/../../../etc/passwd",
            "/..%2F..%2Fetc%2Fpasswd",
            "/v1/models/..%2F..%2Foutside%2Fsecret.txt",
            "/%2e%2e/%2e%2e/outside/secret.txt",
            "/static/../../outside/secret.txt",
            "/docs/../../outside/secret.txt",
            "/" + quote(str(outside / "secret.txt"), safe=""),
            "//etc/passwd",
            "/v1/models/" + quote("../../etc/passwd", safe=""),
        ):
            status, data = raw_get(port, target)
            assert 400 <= status < 500, (target, data[:300])
            assert b"not for clients" not in data and b"root:" not in data
    finally:
        watch.active = False
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in outside.iterdir()}
    assert after == before
    assert sorted(p.name for p in model_dir.parent.iterdir()) == listing
    # Serving a request opens nothing outside the model folder (it needs no file at all once loaded).
    folder = str(model_dir.resolve())
    stray = [
        (e, p)
        for e, p in watch.seen
        if not os.path.realpath(p).startswith(folder)
        and not p.startswith(("/proc/", "/dev/"))
        and "site-packages" not in p
        and not p.endswith((".py", ".pyc", ".so"))
    ]
    assert stray == []
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_hostile_fields_elsewhere_are_plain_text(watched_server):
    """Path-like strings in the other string fields are only ever text: tokenized or generated from,
    never opened."""
    base, _, watch = watched_server
    watch.active = True
    try:
        for text in ("../../etc/passwd", "/etc/passwd", "file:///etc/passwd"):
            out = httpx.post(base + "/tokenize", json={"prompt": text}, headers=AUTH, timeout=60)
            assert out.status_code == 200
            back = httpx.post(base + "/detokenize", json={"tokens": out.json()["tokens"]}, headers=AUTH, timeout=60)
            assert back.json()["prompt"] == text
            out = httpx.post(
                base + "/v1/completions",
                headers=AUTH,
                timeout=60,
                json={"model": NAME, "prompt": text, "max_tokens": 2, "stop": text, "user": text, "temperature": 0},
            )
            assert out.status_code == 200 and "root:" not in out.text
            out = httpx.post(
                base + "/v1/chat/completions",
                headers=AUTH,
                timeout=60,
                json={
                    "model": NAME,
                    "max_tokens": 2,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": text, "name": text}],
                },
            )
            assert out.status_code == 200 and "root:" not in out.text
    finally:
        watch.active = False
    assert [p for _, p in watch.seen if "passwd" in p] == []
