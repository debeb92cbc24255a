import random
from pathlib import Path

import pytest

from kiln.data.steps.base import STEPS, build_step
from kiln.data.steps.dedup import ExactDedup, LineDedup, MinhashDedup, SimhashDedup, split_units
from kiln.errors import ConfigError


def doc(doc_id: str, text: str) -> dict:
    return {"id": doc_id, "text": text, "source": "test", "meta": {}}


def run_dedup(step, tasks: list[list[dict]], workdir: Path):
    """The executor's three phases: index every task, resolve once, then load + reason per task."""
    step.validate()
    for t, docs in enumerate(tasks):
        step.setup()
        step.index(iter([dict(d, meta=dict(d["meta"])) for d in docs]), workdir, t)
    resolved = step.resolve(workdir, len(tasks))
    kept, dropped = [], []
    for t, docs in enumerate(tasks):
        step.load(workdir, t)
        for d in docs:
            why = step.reason(d)
            (kept if why is None else dropped).append((d, why))
    return resolved, kept, dropped


def test_steps_are_registered_and_built_by_name():
    for name in ("exact_dedup", "line_dedup", "minhash_dedup", "simhash_dedup"):
        assert name in STEPS
    assert build_step("minhash_dedup", {"bands": 16, "rows": 7}, "data.minhash_dedup").num_perm == 112


@pytest.mark.parametrize(
    "step,field",
    [
        (MinhashDedup(bands=10, rows=10), "bands"),
        (MinhashDedup(ngram=0), "ngram"),
        (SimhashDedup(max_distance=4, blocks=4), "blocks"),
        (LineDedup(unit="sentence"), "unit"),
        (LineDedup(buckets=0), "buckets"),
    ],
)
def test_impossible_configs_name_the_field(step, field):
    with pytest.raises(ConfigError) as err:
        step.validate()
    assert err.value.key == field


def test_exact_dedup_normalises_case_and_whitespace_across_tasks(tmp_path):
    tasks = [
        [doc("a", "Hello  World\n"), doc("b", "something else"), doc("c", "")],
        [doc("d", "hello world"), doc("e", "HELLO\tWORLD "), doc("f", "Hello World!")],
    ]
    resolved, kept, dropped = run_dedup(ExactDedup(), tasks, tmp_path)
    assert [d["id"] for d, _ in kept] == ["a", "b", "c", "f"]
    assert [(d["id"], why, d["meta"]["duplicate_of"]) for d, why in dropped] == [
        ("d", "exact_duplicate", "a"),
        ("e", "exact_duplicate", "a"),
    ]
    assert resolved["duplicates"] == 2 and resolved["clusters_with_duplicates"] == 1


def test_repeated_ids_are_told_apart(tmp_path):
    tasks = [[doc("x", "same text"), doc("x", "same text"), doc("x", "other text")]]
    _, kept, dropped = run_dedup(ExactDedup(), tasks, tmp_path)
    assert [d["text"] for d, _ in kept] == ["same text", "other text"]
    assert len(dropped) == 1


def test_split_units_reassemble_the_text():
    text = "a\n\nb  \n \n\nc\nd\r\ne"
    for unit in ("line", "paragraph"):
        assert "".join(c + s for c, s in split_units(text, unit)) == text
    assert [c for c, _ in split_units(text, "paragraph")] == ["a", "b  ", "c\nd\r\ne"]


def test_line_dedup_keeps_first_occurrence_across_tasks(tmp_path):
    tasks = [
        [doc("a", "Cookie banner here\nUnique line one\nShared footer"), doc("b", "unique b\nunique b")],
        [
            doc("c", "COOKIE   banner here\nUnique line three\nshared footer\n"),
            doc("d", "Shared footer\ncookie banner here"),
        ],
    ]
    resolved, kept, dropped = run_dedup(LineDedup(), tasks, tmp_path)
    texts = {d["id"]: d["text"] for d, _ in kept}
    assert texts == {
        "a": "Cookie banner here\nUnique line one\nShared footer",
        "b": "unique b\nunique b",  # repeats inside one document are not its business
        "c": "Unique line three\n",
    }
    assert [(d["id"], why) for d, why in dropped] == [("d", "line_dedup_empty")]
    assert resolved["units_removed"] == 4 and resolved["documents_edited"] == 2


def test_line_dedup_paragraphs_and_min_chars(tmp_path):
    tasks = [
        [
            doc("a", "First paragraph.\nStill first.\n\n}\n\nEnd."),
            doc("b", "first paragraph. still first.\n\n}\n\nNew ending."),
        ]
    ]
    _, kept, _ = run_dedup(LineDedup(unit="paragraph", min_chars=2), tasks, tmp_path)
    assert [d["text"] for d, _ in kept] == ["First paragraph.\nStill first.\n\n}\n\nEnd.", "}\n\nNew ending."]


def edit(text: str, fraction: float, rng: random.Random) -> str:
    words = text.split()
    for i in rng.sample(range(len(words)), int(fraction * len(words))):
        words[i] = f"edit{rng.randrange(10**9)}"
    return " ".join(words)


def test_minhash_dedup_keeps_exactly_one_per_cluster_across_tasks(tmp_path, stdlib_chunks):
    rng = random.Random(0)
    originals = stdlib_chunks(60, words=200, reverse=True)
    tasks: list[list[dict]] = [[], [], []]
    for i, text in enumerate(originals):
        tasks[i % 3].append(doc(f"orig{i}", text))
    for i, text in enumerate(originals[:20]):  # 2 near copies each, in other tasks (~97% Jaccard)
        tasks[(i + 1) % 3].append(doc(f"near{i}a", edit(text, 0.01, rng)))
        tasks[(i + 2) % 3].append(doc(f"near{i}b", edit(text, 0.01, rng)))
    resolved, kept, dropped = run_dedup(MinhashDedup(), tasks, tmp_path)
    order = [d["id"] for task in tasks for d in task]  # input order: task 0 first
    kept_ids = {d["id"] for d, _ in kept}
    assert {f"orig{i}" for i in range(20, 60)} <= kept_ids
    for i in range(20):
        cluster = [f"orig{i}", f"near{i}a", f"near{i}b"]
        first = min(cluster, key=order.index)
        assert kept_ids & set(cluster) == {first}
        assert {d["meta"]["duplicate_of"] for d, _ in dropped if d["id"] in cluster} == {first}
    assert len(kept) == 60 and {why for _, why in dropped} == {"minhash_duplicate"}
    assert resolved["clusters_with_duplicates"] == 20


def test_minhash_dedup_survivor_is_first_in_input_order(tmp_path, stdlib_chunks):
    text = stdlib_chunks(1, words=200, reverse=True)[0]
    rng = random.Random(5)
    tasks = [[doc("late", edit(text, 0.01, rng))], [doc("first", text)]]
    _, kept, dropped = run_dedup(MinhashDedup(), [tasks[1], tasks[0]], tmp_path)
    assert [d["id"] for d, _ in kept] == ["first"]
    assert dropped[0][0]["meta"]["duplicate_of"] == "first"


def test_minhash_dedup_chinese_uses_characters(tmp_path):
    zh = "天地玄黄宇宙洪荒日月盈昃辰宿列张寒来暑往秋收冬藏闰余成岁律吕调阳云腾致雨露结为霜金生丽水玉出昆冈"
    tasks = [[doc("a", zh), doc("b", zh[:-1] + "山"), doc("c", "剑号巨阙珠称夜光果珍李柰菜重芥姜海咸河淡鳞潜羽翔")]]
    _, kept, dropped = run_dedup(MinhashDedup(), tasks, tmp_path)
    assert [d["id"] for d, _ in kept] == ["a", "c"] and dropped[0][0]["id"] == "b"


def test_simhash_dedup_finds_near_duplicates_within_k_bits(tmp_path, stdlib_chunks):
    originals = stdlib_chunks(40, words=200, reverse=True)
    tasks = [
        [doc(f"o{i}", t) for i, t in enumerate(originals[:20])],
        [doc(f"o{i}", t) for i, t in enumerate(originals[20:], start=20)]
        + [doc(f"copy{i}", t.replace(" ", "  ")) for i, t in enumerate(originals[:10])],
    ]
    resolved, kept, dropped = run_dedup(SimhashDedup(), tasks, tmp_path)
    assert {d["id"] for d, _ in kept} == {f"o{i}" for i in range(40)}
    assert sorted(d["meta"]["duplicate_of"] for d, _ in dropped) == sorted(f"o{i}" for i in range(10))


def test_empty_task_and_no_duplicates(tmp_path):
    for step in (ExactDedup(), LineDedup(), MinhashDedup(), SimhashDedup()):
        work = tmp_path / step.name
        _, kept, dropped = run_dedup(step, [[], [doc("a", "alpha beta"), doc("b", "gamma delta")]], work)
        assert len(kept) == 2 and dropped == []
