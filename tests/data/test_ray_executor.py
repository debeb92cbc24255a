"""The Ray executor runs the local executor's pipeline unchanged: same output, same stats, same resumption."""

import json
import sys
from dataclasses import dataclass

import pytest
from kiln_testing.curation import make_inputs, read_folder, without_seconds

from kiln.data.executor import run_pipeline
from kiln.data.steps.base import Filter, build_step
from kiln.errors import DataError

ray = pytest.importorskip("ray")

from kiln.data.ray_executor import PROBE, _checked_run_task, run_pipeline_ray  # noqa: E402


@dataclass
class Explode(Filter):
    """Keeps everything, but raises on one id: a crash planted in the phase after deduplication."""

    name = "test_explode"
    explode_on: str = ""

    def reason(self, doc):
        if doc["id"] == self.explode_on:
            raise RuntimeError("planted crash")
        return None


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # Tests' classes (Explode) live in a module Ray's workers cannot import: ship them by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def steps(explode_on=""):
    return [
        build_step("normalize", {}, "normalize"),
        build_step("exact_dedup", {}, "exact_dedup"),
        Explode(explode_on=explode_on),
        build_step("pii", {}, "pii"),
    ]


def test_ray_matches_local_executor(tmp_path):
    inputs = make_inputs(tmp_path / "in")
    local = run_pipeline(inputs, steps(), tmp_path / "local", tasks=3, workers=1)
    on_ray = run_pipeline_ray(inputs, steps(), tmp_path / "ray", tasks=3)

    docs = read_folder(tmp_path / "ray" / "docs")
    assert sorted(docs) == ["part-00000.jsonl", "part-00001.jsonl", "part-00002.jsonl"]
    assert docs == read_folder(tmp_path / "local" / "docs")
    assert read_folder(tmp_path / "ray" / "rejected") == read_folder(tmp_path / "local" / "rejected")
    assert without_seconds(on_ray) == without_seconds(local)
    assert json.loads((tmp_path / "ray" / "stats.json").read_text())["docs_out"] == on_ray["docs_out"]
    # The steps really acted, so the comparison above compares something.
    by_step = {s["name"]: s for s in on_ray["steps"]}
    assert by_step["read"]["reasons"] == {"bad_json": 4}
    assert by_step["exact_dedup"]["reasons"]["exact_duplicate"] > 0
    texts = [d["text"] for part in docs.values() for d in part]
    assert texts and all("<EMAIL>" in t and "<PHONE>" in t and "\x07" not in t for t in texts)


def test_rerun_after_crash_resumes_from_markers(tmp_path):
    inputs = make_inputs(tmp_path / "in")
    clean = run_pipeline(inputs, steps(), tmp_path / "clean", tasks=3, workers=1)

    out = tmp_path / "crashed"
    # Document 1-00 is unique, so it survives dedup and reaches the crash in phase 1 (task 1's shard).
    with pytest.raises(RuntimeError, match="planted crash"):
        run_pipeline_ray(inputs, steps(explode_on="1-00"), out, tasks=3)
    work = out / "work"
    assert sorted(p.name for p in (work / "phase-0").glob("done-*")) == ["done-00000", "done-00001", "done-00002"]
    # The other tasks of the failing phase still finished, so the rerun has only task 1 left.
    assert sorted(p.name for p in (work / "phase-1").glob("done-*")) == ["done-00000", "done-00002"]
    kept = [
        *(work / "phase-0").glob("part-*.jsonl"),
        work / "phase-0" / "dedup" / "resolved.json",
        out / "docs" / "part-00000.jsonl",
        out / "docs" / "part-00002.jsonl",
    ]
    mtimes = {p: p.stat().st_mtime_ns for p in kept}

    resumed = run_pipeline_ray(inputs, steps(), out, tasks=3)
    assert {p: p.stat().st_mtime_ns for p in kept} == mtimes  # finished work and the dedup decision not redone
    assert read_folder(out / "docs") == read_folder(tmp_path / "clean" / "docs")
    assert without_seconds(resumed) == without_seconds(clean)


def test_task_refuses_an_output_folder_the_driver_did_not_write(tmp_path):
    # What a node without the shared filesystem sees: no probe, or another run's.
    (tmp_path / "work").mkdir()
    with pytest.raises(DataError, match="probe missing"):
        _checked_run_task(None, 0, [], tmp_path, True, "driver-token")
    (tmp_path / "work" / PROBE).write_text("another-token")
    with pytest.raises(DataError, match="not the driver's"):
        _checked_run_task(None, 0, [], tmp_path, True, "driver-token")
