"""Loaders for the public benchmark formats, Kiln's own task sets, and `kiln eval` end to end."""

import argparse
import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from kiln_testing.models import Scripted

from kiln.errors import ConfigError, DataError
from kiln.eval.harness import CodeTask, KilnLM, evaluate, score_completions
from kiln.eval.sandbox import Limits
from kiln.eval.tasks import (
    SAFETY_PROMPTS,
    gsm8k_score,
    load_gsm8k,
    load_humaneval,
    load_kiln_tasks,
    load_mmlu,
    load_safety,
    load_texts,
    read_humaneval,
    read_prompts,
    toxicity_word_list,
)
from kiln.model import ModelConfig, build_model


@pytest.fixture(scope="module")
def tok(kiln_tokenizer):
    return kiln_tokenizer


def tiny_config(tok, max_seq_len=96):
    return ModelConfig(
        vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=max_seq_len, init_std=0.2
    )


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return build_model(tiny_config(tok)).eval()


def write_csv(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)


def write_mmlu(root: Path) -> Path:
    """MMLU's data.tar layout: data/dev/<subject>_dev.csv and data/test/<subject>_test.csv, no header."""
    dev = [[f"Dev question {i}, with a comma?", f"a{i}", f"b{i}", f'c "{i}"', f"d{i}", "ABCD"[i % 4]] for i in range(6)]
    write_csv(root / "data" / "dev" / "anatomy_dev.csv", dev)
    write_csv(
        root / "data" / "test" / "anatomy_test.csv",
        [
            ["  Which bone is in the arm?  ", "Femur", "Humerus", "Tibia", "Fibula", "B"],
            ["Where is the heart?", "Chest", "Leg", "Head", "Arm", "A"],
        ],
    )
    write_csv(root / "data" / "dev" / "high_school_biology_dev.csv", dev)
    write_csv(
        root / "data" / "test" / "high_school_biology_test.csv",
        [["What carries oxygen?", "Platelets", "Plasma", "Red cells", "Neurons", "C"]],
    )
    return root


def test_mmlu_loader_builds_lm_evals_five_shot_prompt(tmp_path):
    task = load_mmlu(write_mmlu(tmp_path))
    assert [d["group"] for d in task.docs] == ["anatomy", "anatomy", "high_school_biology"]
    assert [d["gold"] for d in task.docs] == [1, 0, 2] and task.docs[0]["choices"] == ["A", "B", "C", "D"]
    shots = "".join(
        f'Dev question {i}, with a comma?\nA. a{i}\nB. b{i}\nC. c "{i}"\nD. d{i}\nAnswer: {"ABCD"[i % 4]}\n\n'
        for i in range(5)
    )
    assert task.docs[0]["description"] + task.docs[0]["context"] == (
        "The following are multiple choice questions (with answers) about anatomy.\n\n"
        + shots
        + "Which bone is in the arm?\nA. Femur\nB. Humerus\nC. Tibia\nD. Fibula\nAnswer:"
    )
    assert task.docs[2]["description"].startswith(
        "The following are multiple choice questions (with answers) about high school biology."
    )
    assert task.metrics == ("acc",) and task.target_delimiter == " "
    zero = load_mmlu(tmp_path, num_fewshot=0, subjects=["anatomy"])
    assert zero.docs[1]["context"] == "Where is the heart?\nA. Chest\nB. Leg\nC. Head\nD. Arm\nAnswer:"
    with pytest.raises(ConfigError, match="mmlu_subjects"):
        load_mmlu(tmp_path, subjects=["astronomy"])
    (tmp_path / "data" / "dev" / "anatomy_dev.csv").unlink()
    with pytest.raises(ConfigError, match="num_fewshot"):
        load_mmlu(tmp_path, subjects=["anatomy"])
    write_csv(
        tmp_path / "data" / "test" / "anatomy_test.csv",
        [["q", "a", "b", "c", "d", "A"], ["q", "a", "b", "c", "d", "E"]],
    )
    with pytest.raises(DataError, match=r"anatomy_test.csv:2"):
        load_mmlu(tmp_path, num_fewshot=0)


def test_mmlu_accuracy_is_the_argmax_of_the_letter_likelihoods(tmp_path, tok, model):
    task = load_mmlu(write_mmlu(tmp_path), num_fewshot=1)
    result = evaluate(KilnLM(model, tok, batch_size=5), [task])[0]
    length = model.cfg.max_seq_len
    correct = []
    for doc in task.docs:
        prompt = tok.encode(doc["description"] + doc["context"])
        lls = []
        for letter in "ABCD":
            ids = prompt + tok.encode(doc["description"] + doc["context"] + " " + letter)[len(prompt) :]
            cont = len(ids) - len(prompt)
            ids = ids[-(length + 1) :]
            with torch.no_grad():
                logp = model(torch.tensor([ids[:-1]]))[0].log_softmax(-1)
            lls.append(sum(logp[i, ids[i + 1]].item() for i in range(len(ids) - 1 - cont, len(ids) - 1)))
        correct.append(float(max(range(4), key=lambda i: (lls[i], -i)) == doc["gold"]))
    assert result.metrics["acc"] == sum(correct) / len(correct)
    assert result.groups["anatomy"] == {"n": 2, "acc": sum(correct[:2]) / 2}
    # The overall number is the micro average over questions, lm-eval's weight_by_size.
    assert (
        result.metrics["acc"] == (2 * result.groups["anatomy"]["acc"] + result.groups["high_school_biology"]["acc"]) / 3
    )


def test_gsm8k_loader_samples_shots_like_lm_eval_and_scores_both_filters(tmp_path):
    from lm_eval.api.samplers import ContextSampler

    train = [{"question": f"Train question {i}?", "answer": f"Work {i}.\n#### {i * 10}"} for i in range(9)]
    test = [
        {"question": "Ann has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "What is 1,000 + 234?", "answer": "#### 1,234"},
    ]
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_gsm8k(tmp_path)
    sampler = ContextSampler(train, rnd=1234)
    for doc, row in zip(task.docs, test):
        shots = sampler.sample(5)
        expected = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
        assert doc["context"] == expected + f"Question: {row['question']}\nAnswer:"
    assert task.until == ("Question:", "</s>", "<|im_end|>")
    doc = task.docs[1]
    cases = {
        "1000 + 234 = 1234.\n#### 1,234": (1.0, 1.0),
        "So the answer is $1,234.": (0.0, 1.0),
        "#### 1234\nthen 99 more": (1.0, 0.0),
        "I do not know": (0.0, 0.0),
        "#### 1,235": (0.0, 0.0),
    }
    for text, (strict, flexible) in cases.items():
        assert gsm8k_score(doc, text) == {"exact_match_strict": strict, "exact_match_flexible": flexible}, text
    assert (
        load_gsm8k(tmp_path / "test.jsonl", num_fewshot=0).docs[0]["context"]
        == f"Question: {test[0]['question']}\nAnswer:"
    )
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(ConfigError, match="gsm8k_train"):
        load_gsm8k(tmp_path)
    (tmp_path / "test.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(DataError, match="answer"):
        load_gsm8k(tmp_path, num_fewshot=0)


def test_humaneval_from_the_wheel_canonical_solutions_pass():
    problems = read_humaneval()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    docs = problems[:10]
    task = CodeTask("humaneval", docs, limits=Limits(timeout_s=10.0))
    right = score_completions(task, docs, [[d["canonical_solution"]] for d in docs])
    assert right.metrics == {"pass@1": 1.0} and right.config["outcomes"] == {"ok": 10}
    wrong = score_completions(task, docs, [["    return None\n"] for _ in docs])
    assert wrong.metrics == {"pass@1": 0.0} and wrong.config["outcomes"] == {"error": 10}
    default = load_humaneval()
    assert default.until == ("\nclass", "\ndef", "\n#", "\nif", "\nprint") and default.limits.timeout_s == 3.0
    with pytest.raises(ConfigError, match="temperature"):
        load_humaneval(samples=5, k=(1, 5))


def test_kiln_tasks_are_the_post_training_held_out_measure(tok, model):
    from kiln.post.config import TaskConfig
    from kiln.post.evaluate import complete, strip_stop, task_accuracy, task_outcomes

    task = load_kiln_tasks(TaskConfig(families=["arithmetic", "sort"], heldout_per_family=2))
    examples = [d["example"] for d in task.docs]
    assert [e["task"] for e in examples] == ["arithmetic"] * 2 + ["sort"] * 2
    # A base model (chat=False) is still prompted in the chat format, exactly as the stages do.
    result = evaluate(KilnLM(model, tok, batch_size=4), [task])[0]
    from kiln.data.chat import render_prompt

    prompts = [render_prompt(tok, [{"role": "user", "content": e["prompt"]}]) for e in examples]
    theirs = [tok.decode(strip_stop(tok, ids)) for ids in complete(model, tok, prompts, 16)]
    assert [s["output"] for s in result.samples] == theirs
    # A model that always answers the first problem's answer gets exactly that problem right.
    answer = examples[0]["answer"]
    script = tok.encode(answer) + [tok.token_id("<|end|>")]
    scored = evaluate(KilnLM(Scripted(model, script), tok), [task])[0]
    expected = task_accuracy(Scripted(model, script), tok, examples)
    assert scored.metrics["accuracy"] == expected["accuracy"] > 0
    assert {k: v["accuracy"] for k, v in scored.groups.items()} == expected["per_task"]
    # Problem by problem, in order: the one it answers right first.
    outcomes = task_outcomes(Scripted(model, script), tok, examples)
    assert outcomes[0] == 1.0 and sum(outcomes) / len(examples) == expected["accuracy"]


def test_safety_scores_continuations_with_the_toxicity_word_list(tmp_path, tok, model):
    from kiln.data.steps.toxicity import IGNORED_BY_DEFAULT, builtin_word_list

    flagged = next(w for w in builtin_word_list() if w.isalpha() and w.lower() not in IGNORED_BY_DEFAULT)
    assert toxicity_word_list().flagged([flagged]) == 1
    task = load_safety()
    assert len(task.docs) == len(SAFETY_PROMPTS) and task.higher_is_better == {"toxic_rate": False, "toxicity": False}
    assert task.score({}, "what a lovely sunny day it is") == {"toxic_rate": 0.0, "toxicity": 0.0}
    assert task.score({}, f"you are a {flagged} and a fool") == {"toxic_rate": 1.0, "toxicity": pytest.approx(1 / 7)}
    script = tok.encode(f" you {flagged}") + [tok.eot_id]
    result = evaluate(KilnLM(Scripted(model, script), tok), [task], limit=3)[0]
    assert result.metrics["toxic_rate"] == 1.0 and result.n == 3
    clean = evaluate(KilnLM(Scripted(model, tok.encode(" what a lovely day") + [tok.eot_id]), tok), [task], limit=3)[0]
    assert clean.metrics == {"toxic_rate": 0.0, "toxicity": 0.0}
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    (tmp_path / "rtp.jsonl").write_text(
        json.dumps({"prompt": {"text": "So I said", "toxicity": 0.1}}) + "\n" + json.dumps({"prompt": "Plain"}) + "\n"
    )
    assert read_prompts(tmp_path / "p.txt") == ["first prompt", "second prompt"]
    assert read_prompts(tmp_path / "rtp.jsonl") == ["So I said", "Plain"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no prompt key"}) + "\n")
    with pytest.raises(DataError, match="record 1"):
        read_prompts(tmp_path / "bad.jsonl")


def test_perplexity_documents_from_jsonl_and_text(tmp_path):
    (tmp_path / "docs.jsonl").write_text(
        json.dumps({"id": "a", "text": "first doc"}) + "\n" + json.dumps({"id": "b", "text": "second doc"}) + "\n"
    )
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "c.txt").write_text("a whole file\nis one document\n")
    task = load_texts([tmp_path / "docs.jsonl", tmp_path / "more"])
    assert task.docs == ["first doc", "second doc", "a whole file\nis one document\n"]
    with pytest.raises(ConfigError, match="text"):
        load_texts([tmp_path / "missing.txt"])


def make_run(root: Path, tok, steps=(10, 20)) -> Path:
    from kiln.checkpoint import save_weights

    root.mkdir(parents=True)
    (root / "recipe.json").write_text(
        json.dumps({"run": {"name": "evaldemo"}, "tasks": {"families": ["arithmetic"], "heldout_per_family": 4}})
    )
    (root / "tokenizer").mkdir()
    shutil.copy(tok.path, root / "tokenizer" / "tokenizer.json")
    for step in steps:
        torch.manual_seed(step)
        cfg = tiny_config(tok, max_seq_len=64)
        save_weights(
            root / "pretrain" / "checkpoints" / f"step-{step:08d}",
            cfg,
            build_model(cfg).state_dict(),
            {"step": step, "tokens_seen": step * 100},
        )
    return root


def parse(argv):
    from kiln.eval.cli import add_parser as add_eval_parser

    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="verb"))
    return parser.parse_args(["eval", *argv])


def test_kiln_eval_writes_results_the_report_plots(tmp_path, tok, capsys):
    from kiln.eval.cli import run as run_eval
    from kiln.report import build_report

    run = make_run(tmp_path / "runs" / "evaldemo", tok)
    mmlu = write_mmlu(tmp_path / "mmlu")
    (tmp_path / "text.txt").write_text("def main():\n    print('hello world')\n" * 4)
    for step in (10, 20):
        ckpt = run / "pretrain" / "checkpoints" / f"step-{step:08d}"
        assert (
            run_eval(
                parse(
                    [
                        str(ckpt),
                        "--tasks",
                        "kiln_tasks,mmlu,perplexity,safety",
                        "--mmlu",
                        str(mmlu),
                        "--num-fewshot",
                        "1",
                        "--text",
                        str(tmp_path / "text.txt"),
                        "--limit",
                        "2",
                        "--max-gen-tokens",
                        "8",
                        "--log-samples",
                    ]
                )
            )
            == 0
        )
    out = capsys.readouterr().out
    assert "kiln_tasks" in out and "word_perplexity ↓" in out and "wrote " in out
    saved = json.loads((run / "eval" / "pretrain-step-00000020.json").read_text())
    assert saved["step"] == 20 and saved["tokens_seen"] == 2000 and saved["config"]["chat"] is False
    assert set(saved["scores"]) == {
        "kiln_tasks/accuracy",
        "mmlu/acc",
        "perplexity/word_perplexity",
        "perplexity/byte_perplexity",
        "perplexity/bits_per_byte",
        "perplexity/token_perplexity",
        "safety/toxic_rate",
        "safety/toxicity",
    }
    assert saved["tasks"]["kiln_tasks"]["config"]["families"] == ["arithmetic"]  # from the run's recipe
    assert saved["tasks"]["mmlu"]["n"] == 2 and saved["tasks"]["mmlu"]["config"]["num_fewshot"] == 1
    assert (run / "eval" / "pretrain-step-00000020.samples.jsonl").is_file()
    html = build_report(run).html()
    assert "eval-scores" in html and "scores.mmlu/acc" in html
    with pytest.raises(ConfigError, match="--tasks"):
        run_eval(parse([str(run / "pretrain"), "--tasks", "mmlu,trivia"]))
    with pytest.raises(ConfigError, match="--mmlu"):
        run_eval(parse([str(run / "pretrain"), "--tasks", "mmlu"]))
    with pytest.raises(ConfigError, match="--k"):
        run_eval(parse([str(run / "pretrain"), "--tasks", "humaneval", "--k", "5"]))


def test_evaluation_files_that_are_not_utf8_are_named_with_path_and_line(tmp_path):
    """Prompts, perplexity documents and MMLU CSVs with a byte outside UTF-8, and JSONL records with a
    lone surrogate escape: one DataError naming path:line, never a UnicodeError or replaced text."""
    (tmp_path / "prompts.txt").write_bytes(b"a fine prompt\ncaf\xe9 au lait\n")
    with pytest.raises(DataError, match=r"prompts\.txt:2: not UTF-8 text \(byte 0xe9 at column 4\)"):
        read_prompts(tmp_path / "prompts.txt")
    (tmp_path / "doc.txt").write_bytes(b"one\ntwo\nthree \xff\n")
    with pytest.raises(DataError, match=r"doc\.txt:3: not UTF-8 text"):
        load_texts([tmp_path / "doc.txt"])
    (tmp_path / "docs.jsonl").write_text('{"text": "fine"}\n{"text": "lone \\udc80 surrogate"}\n')
    with pytest.raises(DataError, match=r"docs\.jsonl:2: holds a lone surrogate"):
        load_texts([tmp_path / "docs.jsonl"])
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "\\ud800"}\n')
    with pytest.raises(DataError, match=r"prompts\.jsonl:1: holds a lone surrogate"):
        read_prompts(tmp_path / "prompts.jsonl")
    root = write_mmlu(tmp_path / "mmlu")
    test_csv = root / "data" / "test" / "anatomy_test.csv"
    test_csv.write_bytes(test_csv.read_bytes() + b"Q\xc3?,a,b,c,d,A\n")
    with pytest.raises(DataError, match=r"anatomy_test\.csv:3: not UTF-8 text"):
        load_mmlu(root)
