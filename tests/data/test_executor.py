"""The curation executor: phases, tasks, stats, rejected records, and resumption after a crash."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pytest

from kiln.data.executor import run_pipeline, split_phases
from kiln.data.funnel import funnel_html, funnel_rows, funnel_text
from kiln.data.steps.base import Deduplicator, Filter, Mapper


@dataclass
class Upper(Mapper):
    name = "test_upper"

    def apply(self, doc):
        doc["text"] = doc["text"].upper()
        self.stats.count("changed")
        return doc


@dataclass
class DropShort(Filter):
    name = "test_drop_short"
    min_chars: int = 5
    explode_on: str = ""  # raise on this id, standing in for a crash mid-run

    def reason(self, doc):
        if doc["id"] == self.explode_on:
            raise RuntimeError("planted crash")
        return "too_short" if len(doc["text"]) < self.min_chars else None


@dataclass
class ExactText(Deduplicator):
    """Keeps the first document (lowest id) of each distinct text, across all tasks."""

    name = "test_exact"

    def index(self, docs: Iterable[dict], workdir: Path, task: int) -> None:
        (workdir / f"{task}.json").write_text(json.dumps([[d["text"], d["id"]] for d in docs]))

    def resolve(self, workdir: Path, n_tasks: int) -> dict:
        first, drop = {}, []
        pairs = sorted(p for t in range(n_tasks) for p in json.loads((workdir / f"{t}.json").read_text()))
        for text, doc_id in pairs:
            if text in first:
                drop.append(doc_id)
            else:
                first[text] = doc_id
        (workdir / "drop.json").write_text(json.dumps(drop))
        return {"clusters": len(first), "dropped": len(drop)}

    def load(self, workdir: Path, task: int) -> None:
        self.drop = set(json.loads((workdir / "drop.json").read_text()))

    def reason(self, doc):
        return "duplicate" if doc["id"] in self.drop else None


def make_inputs(root: Path, files: int = 4, docs: int = 25) -> list[Path]:
    root.mkdir()
    paths = []
    for f in range(files):
        path = root / f"in-{f}.jsonl"
        lines = []
        for d in range(docs):
            text = "x" * (d % 7) + f" body {d % 10}"  # repeats across files: duplicates to find
            lines.append(json.dumps({"id": f"{f}-{d:02d}", "text": text, "source": "test", "meta": {}}))
        lines.append("{not json")  # malformed: counted and quarantined by the reader
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths


def steps(explode_on=""):
    return [Upper(), DropShort(min_chars=8, explode_on=explode_on), ExactText(), Upper()]


def read_output(out: Path) -> list[dict]:
    return [json.loads(line) for p in sorted((out / "docs").glob("*.jsonl")) for line in p.open()]


def test_phases_split_at_deduplicators():
    phases = split_phases(steps())
    assert [[s.name for s in p.steps] for p in phases] == [["test_upper", "test_drop_short"], ["test_upper"]]
    assert phases[0].dedup.name == phases[1].dedup_before.name == "test_exact"


@pytest.mark.parametrize("workers", [1, 2])
def test_pipeline_counts_everything_and_drops_nothing_silently(tmp_path, workers):
    inputs = make_inputs(tmp_path / "in")
    stats = run_pipeline(inputs, steps(), tmp_path / "out", tasks=3, workers=workers)
    docs = read_output(tmp_path / "out")
    rejected = [json.loads(line) for p in (tmp_path / "out" / "rejected").glob("*.jsonl") for line in p.open()]
    by_step = {s["name"]: s for s in stats["steps"]}
    assert by_step["read"]["reasons"] == {"bad_json": 4}
    assert stats["docs_in"] == 104 and stats["docs_out"] == len(docs)
    # Every input is either in the output or rejected with its step and reason.
    assert len(docs) + len(rejected) == 104
    assert {(r["step"], r["reason"]) for r in rejected} == {
        ("read", "bad_json"),
        ("test_drop_short", "too_short"),
        ("test_exact", "duplicate"),
    }
    assert len({d["text"] for d in docs}) == len(docs)  # duplicates across tasks were removed
    assert all(d["text"].isupper() or not d["text"].isalpha() for d in docs)
    assert by_step["test_exact"]["counters"]["dropped"] == by_step["test_exact"]["reasons"]["duplicate"]
    rows = funnel_rows(stats)
    assert [r["name"] for r in rows] == ["read", "test_upper", "test_drop_short", "test_exact", "test_upper"]
    assert rows[0]["docs_share"] == 100 / 104 and rows[-1]["docs"] == len(docs)
    assert all(a["docs"] >= b["docs"] for a, b in zip(rows, rows[1:]))  # a funnel only narrows
    assert "test_drop_short" in funnel_text(stats) and "too_short" in funnel_html(stats)


def test_rerun_after_crash_redoes_only_unfinished_tasks(tmp_path):
    inputs = make_inputs(tmp_path / "in")
    clean = run_pipeline(inputs, steps(), tmp_path / "clean", tasks=4, workers=1)

    out = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="planted crash"):
        run_pipeline(inputs, steps(explode_on="2-03"), out, tasks=4, workers=1)  # file 2 is task 2's
    work = out / "work" / "phase-0"
    assert sorted(p.name for p in work.glob("done-*")) == ["done-00000", "done-00001"]
    finished = {p: p.stat().st_mtime_ns for p in work.glob("part-0000[01].jsonl")}

    resumed = run_pipeline(inputs, steps(), out, tasks=4, workers=1)
    assert {p: p.stat().st_mtime_ns for p in finished} == finished  # not redone
    assert read_output(out) == read_output(tmp_path / "clean")
    strip = lambda s: {k: v for k, v in s.items() if k != "seconds"}  # noqa: E731
    assert [strip(s) for s in resumed["steps"]] == [strip(s) for s in clean["steps"]]


def test_only_sources_limits_a_step_to_some_sources(tmp_path):
    inputs = make_inputs(tmp_path / "in", files=2)
    stats = run_pipeline(inputs, [Upper(only_sources=["elsewhere"])], tmp_path / "out", tasks=1)
    upper = stats["steps"][1]
    assert upper["docs_in"] == upper["docs_out"] == upper["counters"]["other_source"] == 50
    docs = read_output(tmp_path / "out")
    assert len(docs) == 50 and all("body" in d["text"] for d in docs)  # untouched: not upper-cased
