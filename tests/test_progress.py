"""The progress bars of the long-running verbs: shown on rank 0 only, forced on or off by
KILN_PROGRESS, and never changing what a stage computes."""

import json

import pytest
import torch

from kiln.progress import PROGRESS_ENV, progress, progress_enabled


@pytest.mark.parametrize(
    "rank, forced, expected",
    [("0", "", None), ("0", "1", True), ("0", "0", False), ("1", "1", False), ("3", "", False)],
)
def test_progress_follows_rank_and_the_override(monkeypatch, rank, forced, expected):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv(PROGRESS_ENV, forced)
    assert progress_enabled() is expected


def test_bar_writes_rate_and_eta_to_stderr_only_when_enabled(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert list(progress(range(5), desc="things", unit="doc")) == list(range(5))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "things" in captured.err and "5/5" in captured.err and "doc/s" in captured.err
    monkeypatch.delenv(PROGRESS_ENV)  # default: only on a terminal, and capsys is not one
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
        monkeypatch.setenv(PROGRESS_ENV, forced)
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
        monkeypatch.setenv(PROGRESS_ENV, forced)
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
        monkeypatch.setenv(PROGRESS_ENV, forced)
        results = evaluate(KilnLM(model, tok, batch_size=2), tasks)
        scores[forced] = [r.metrics for r in results]
        err = capsys.readouterr().err
        if forced == "1":
            # The first draw (0/5) always happens; later ones depend on tqdm's redraw interval.
            assert "ppl loglikelihood" in err and "gen generate" in err and "0/5 [" in err and "req/s" in err
    assert scores["0"] == scores["1"]
