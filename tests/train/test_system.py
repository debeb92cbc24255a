"""System metrics for the training log, and the progress bars of the long-running verbs."""

import json
import math

import psutil
import pytest
import torch

from kiln.train import system
from kiln.train.system import progress, progress_enabled, system_metrics

CPU_KEYS = {"sys/cpu_percent", "sys/proc_cpu_percent", "sys/ram_mb", "sys/rss_mb"}


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_metrics_have_the_documented_keys_and_sane_values(device):
    metrics = system_metrics(device)
    assert set(metrics) == CPU_KEYS  # no GPU keys without a GPU
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    total_mb = psutil.virtual_memory().total / 2**20
    assert 0.0 <= metrics["sys/cpu_percent"] <= 100.0
    assert 0.0 <= metrics["sys/proc_cpu_percent"] <= 100.0 * psutil.cpu_count()
    assert 0.0 < metrics["sys/rss_mb"] < total_mb
    assert 0.0 < metrics["sys/ram_mb"] <= total_mb
    json.dumps(metrics)  # goes into metrics.jsonl as is


def test_rss_is_this_process_and_cpu_counts_work_done_since_the_last_call():
    system_metrics("cpu")
    before = system_metrics("cpu")["sys/rss_mb"]
    block = b"\x01" * (96 * 2**20)  # written, so its pages are resident
    after = system_metrics("cpu")
    assert after["sys/rss_mb"] - before >= 80
    del block
    sum(i * i for i in range(3_000_000))  # CPU work in this process between two calls
    assert system_metrics("cpu")["sys/proc_cpu_percent"] > 0.0


def test_cuda_keys_come_from_torch_and_utilisation_is_optional(monkeypatch):
    # Stand-ins for the CUDA calls, so the GPU branch runs on a machine without a GPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "utilization", lambda device: 87)
    metrics = system_metrics("cuda")
    assert set(metrics) == CPU_KEYS | {"sys/gpu_util", "sys/gpu_mem_mb", "sys/gpu_mem_used_mb"}
    assert metrics["sys/gpu_util"] == 87.0
    assert metrics["sys/gpu_mem_mb"] == 3 * 1024 and metrics["sys/gpu_mem_used_mb"] == 20 * 1024

    def no_nvml(device):
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    metrics = system_metrics(torch.device("cuda", 0))
    assert "sys/gpu_util" not in metrics and metrics["sys/gpu_mem_mb"] == 3 * 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_follows_a_real_allocation():
    before = system_metrics("cuda")["sys/gpu_mem_mb"]
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    metrics = system_metrics("cuda")
    assert metrics["sys/gpu_mem_mb"] - before >= 64
    assert metrics["sys/gpu_mem_used_mb"] >= metrics["sys/gpu_mem_mb"]
    if "sys/gpu_util" in metrics:
        assert 0.0 <= metrics["sys/gpu_util"] <= 100.0
    del block


# ---- progress bars ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rank, forced, expected",
    [("0", "", None), ("0", "1", True), ("0", "0", False), ("1", "1", False), ("3", "", False)],
)
def test_progress_follows_rank_and_the_override(monkeypatch, rank, forced, expected):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv(system.PROGRESS_ENV, forced)
    assert progress_enabled() is expected


def test_bar_writes_rate_and_eta_to_stderr_only_when_enabled(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(system.PROGRESS_ENV, "1")
    assert list(progress(range(5), desc="things", unit="doc")) == list(range(5))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "things" in captured.err and "5/5" in captured.err and "doc/s" in captured.err
    monkeypatch.delenv(system.PROGRESS_ENV)  # default: only on a terminal, and capsys is not one
    assert list(progress(range(5), desc="things")) == list(range(5))
    assert capsys.readouterr().err == ""


def _inputs(folder, files=3, docs=20):
    folder.mkdir()
    paths = []
    for f in range(files):
        lines = [
            json.dumps({"id": f"{f}-{d}", "text": f"document {d} of file {f} " * 3, "source": "web"})
            for d in range(docs)
        ]
        path = folder / f"in-{f}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths


@pytest.mark.parametrize("workers", [1, 2])
def test_curation_shows_tasks_and_documents_and_keeps_its_output(tmp_path, monkeypatch, capsys, workers):
    from kiln.data.executor import run_pipeline

    paths = _inputs(tmp_path / "in")
    outputs = {}
    for forced in ("0", "1"):
        monkeypatch.setenv(system.PROGRESS_ENV, forced)
        out = tmp_path / f"out-{forced}"
        run_pipeline(paths, [], out, tasks=3, workers=workers, log=lambda _: None)
        outputs[forced] = [p.read_text() for p in sorted((out / "docs").glob("*.jsonl"))]
        err = capsys.readouterr().err
        if forced == "1":
            assert "[data] phase 0" in err and "3/3" in err and "task" in err
            if workers == 1:  # in-process tasks also count their documents
                assert "[data] phase 0 task 2" in err and "doc/s" in err
        else:
            assert err == ""
    assert outputs["0"] == outputs["1"] and len(outputs["1"]) == 3


def test_tokenizer_and_pack_bars_leave_results_unchanged(tmp_path, monkeypatch, capsys):
    from kiln.data.config import PackConfig, TokenizerConfig
    from kiln.data.pack import pack
    from kiln.data.tokenizer import count_documents, train_tokenizer_from_corpus

    corpus = tmp_path / "corpus"
    _inputs(corpus, files=2, docs=30)
    for path in sorted(corpus.glob("*.jsonl")):  # documents as the corpus stage writes them
        path.rename(path.with_name("docs-" + path.name))
    (corpus / "docs-in-1.jsonl").write_text((corpus / "docs-in-1.jsonl").read_text().rstrip("\n"))
    assert count_documents(corpus) == 60  # the last line has no newline and still counts
    results = {}
    for forced in ("0", "1"):
        monkeypatch.setenv(system.PROGRESS_ENV, forced)
        tok = train_tokenizer_from_corpus(corpus, TokenizerConfig(vocab_size=512), tmp_path / f"tok-{forced}")
        stats = pack(
            corpus,
            tmp_path / f"tok-{forced}" / "tokenizer.json",
            PackConfig(val_fraction=0.1),
            tmp_path / f"pack-{forced}",
        )
        err = capsys.readouterr().err
        if forced == "1":
            assert "[pack] tokenize" in err and "60/60" in err and "tokens=" in err
        results[forced] = (
            tok["tokenizer_sha256"],
            {k: v for k, v in stats.items() if k not in ("seconds", "tokens_per_second")},
        )
    assert results["0"] == results["1"]


def test_eval_bars_count_requests_and_leave_scores_unchanged(tmp_path, monkeypatch, capsys):
    from kiln.data.config import TokenizerConfig
    from kiln.data.tokenizer import Tokenizer, train_tokenizer
    from kiln.eval.harness import GenerationTask, KilnLM, PerplexityTask, evaluate
    from kiln.model import ModelConfig, build_model

    texts = [f"the {w} sat on the mat and the {w} ran away" for w in ("cat", "dog", "owl", "fox", "hen")]
    train_tokenizer(texts, TokenizerConfig(vocab_size=512), tmp_path / "tok", heldout=[])
    tok = Tokenizer.load(tmp_path / "tok")
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=64)
    ).eval()
    tasks = [
        PerplexityTask("ppl", texts),
        GenerationTask(
            "gen", [{"context": t[:12]} for t in texts], lambda doc, text: {"len": float(len(text))}, max_gen_toks=4
        ),
    ]
    scores = {}
    for forced in ("0", "1"):
        monkeypatch.setenv(system.PROGRESS_ENV, forced)
        results = evaluate(KilnLM(model, tok, batch_size=2), tasks)
        scores[forced] = [r.metrics for r in results]
        err = capsys.readouterr().err
        if forced == "1":
            # The first draw (0/5) always happens; later ones depend on tqdm's redraw interval.
            assert "ppl loglikelihood" in err and "gen generate" in err and "0/5 [" in err and "req/s" in err
    assert scores["0"] == scores["1"]
