"""Run a list of curation steps over sharded input, as tasks, locally on worker processes.

The pipeline is cut after every `Deduplicator` into phases. Within a phase each task reads its own
shard, runs the phase's steps document by document, and writes its surviving documents to a part
file; a phase that ends in a deduplicator then has that step `index` the part files, `resolve` once
across all tasks, and the next phase starts by filtering each part with the decision. Phases talk
only through files, so a task is the unit of work, of parallelism and of resumption: a task that
finished leaves a marker, and a rerun after a crash redoes only the tasks without one.

Layout of the output folder:
    docs/part-00000.jsonl ...       the curated documents (the last phase's parts)
    rejected/<phase>-part-00000.jsonl  every dropped document with its step and reason
    work/phase-<k>/                 intermediate parts, dedup indexes, markers, per-task stats
    stats.json                      per step: docs/bytes in and out, reasons, counters, seconds
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from kiln.data.readers import read_documents
from kiln.data.steps.base import Deduplicator, Mapper, Step, StepStats
from kiln.progress import progress


@dataclass
class Phase:
    index: int
    steps: list[Step]  # mappers and filters, in order
    dedup: Deduplicator | None  # ends the phase; applied as a filter at the start of the next one
    dedup_before: Deduplicator | None  # the previous phase's deduplicator
    read_options: dict = field(default_factory=dict)  # read_documents keywords (html_extractor), phase 0 only


def split_phases(steps: list[Step]) -> list[Phase]:
    phases, current, previous = [], [], None
    for step in steps:
        if isinstance(step, Deduplicator):
            phases.append(Phase(len(phases), current, step, previous))
            current, previous = [], step
        else:
            current.append(step)
    phases.append(Phase(len(phases), current, None, previous))
    return phases


def assign_inputs(files: list[tuple[Path, str]], tasks: int) -> list[list[tuple[Path, str]]]:
    """Round-robin over the files in their given (sorted) order, so the assignment never depends on
    the machine."""
    return [files[t::tasks] for t in range(tasks)]


def _write_jsonl_atomic(path: Path, records: Iterable[dict]) -> int:
    tmp = path.with_name(path.name + ".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return count


def _read_jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def _run_steps(docs: Iterable[dict], steps: list[Step], rejected: list[dict]) -> Iterator[dict]:
    """Push each document through the steps; count everything; collect the dropped ones."""
    for doc in docs:
        # A document's UTF-8 size is measured once and again only after a step replaced its text
        # (strings are immutable, so an edit is a new object), not twice per step.
        text = doc["text"]
        size = len(text.encode("utf-8"))
        for step in steps:
            stats = step.stats
            stats.docs_in += 1
            stats.bytes_in += size
            if step.only_sources and doc["source"] not in step.only_sources:
                # Passed through untouched: counted as in and out, so the funnel stays cumulative.
                stats.docs_out += 1
                stats.bytes_out += size
                stats.counters["other_source"] += 1
                continue
            started = time.perf_counter()
            if isinstance(step, Mapper):
                doc = step.apply(doc)
                why = None
            else:
                why = step.reason(doc)
            stats.seconds += time.perf_counter() - started
            if why is not None:
                stats.reasons[why] += 1
                rejected.append({"step": step.name, "reason": why, "doc": doc})
                break
            if doc["text"] is not text:
                text = doc["text"]
                size = len(text.encode("utf-8"))
            stats.docs_out += 1
            stats.bytes_out += size
        else:
            yield doc


def _task_inputs(
    phase: Phase, task: int, shards: list[tuple[Path, str]], out: Path, read_stats: StepStats, rejected: list[dict]
) -> Iterator[dict]:
    if phase.index == 0:
        for path, name, *fields in shards:  # (file, stable name[, FieldMap])
            fields = fields[0] if fields else None
            for doc, rejection in read_documents(path, name=name, fields=fields, **phase.read_options):
                if rejection is not None:
                    read_stats.reasons[rejection["reason"]] += 1
                    rejected.append({"step": "read", **rejection})
                    continue
                read_stats.docs_out += 1
                read_stats.bytes_out += len(doc["text"].encode("utf-8"))
                yield doc
    else:
        yield from _read_jsonl(out / "work" / f"phase-{phase.index - 1}" / f"part-{task:05d}.jsonl")


def run_task(
    phase: Phase, task: int, shards: list[tuple[Path, str]], out: Path, final: bool, show_progress: bool = False
) -> None:
    """One task of one phase; writes its part, rejected records, stats and finally its marker.
    show_progress draws a documents bar (for a task run in the driver process, where it has the
    terminal to itself)."""
    work = out / "work" / f"phase-{phase.index}"
    steps = ([phase.dedup_before] if phase.dedup_before else []) + phase.steps
    for step in steps:
        step.stats = StepStats(step.name)
        step.setup()
    if phase.dedup_before is not None:
        phase.dedup_before.load(out / "work" / f"phase-{phase.index - 1}" / "dedup", task)
    read_stats = StepStats("read")
    rejected: list[dict] = []
    inputs = _task_inputs(phase, task, shards, out, read_stats, rejected)
    if show_progress:
        # No total: a task learns its document count only by reading its shard.
        inputs = progress(inputs, desc=f"[data] phase {phase.index} task {task}", unit="doc", leave=False)
    docs = _run_steps(inputs, steps, rejected)
    part = (out / "docs" if final else work) / f"part-{task:05d}.jsonl"
    _write_jsonl_atomic(part, docs)
    if phase.dedup is not None:
        (work / "dedup").mkdir(exist_ok=True)
        phase.dedup.setup()
        phase.dedup.index(_read_jsonl(part), work / "dedup", task)
    _write_jsonl_atomic(out / "rejected" / f"phase-{phase.index}-part-{task:05d}.jsonl", rejected)
    stats = [s.stats.to_dict() for s in steps]
    if phase.index == 0:
        stats.insert(0, read_stats.to_dict())
    (work / f"stats-{task:05d}.json").write_text(json.dumps(stats))
    (work / f"done-{task:05d}").write_text("")


TaskRunner = Callable[[Phase, list[int], list, Path, bool], None]


def local_task_runner(workers: int) -> TaskRunner:
    """Runs a phase's pending tasks on up to `workers` local processes (in this one when 1)."""

    def run_tasks(phase: Phase, pending: list[int], shards: list, out: Path, final: bool) -> None:
        with progress(total=len(pending), desc=f"[data] phase {phase.index}", unit="task") as bar:
            if workers > 1 and len(pending) > 1:
                with ProcessPoolExecutor(max_workers=min(workers, len(pending))) as pool:
                    futures = [pool.submit(run_task, phase, t, shards[t], out, final) for t in pending]
                    for future in futures:
                        # Counted as each finishes (callbacks run in the pool's thread; tqdm locks),
                        # while errors still surface in submission order below.
                        future.add_done_callback(lambda _: bar.update(1))
                    for future in futures:
                        future.result()
            else:
                for t in pending:
                    run_task(phase, t, shards[t], out, final, show_progress=not bar.disable)
                    bar.update(1)

    return run_tasks


def run_pipeline(
    inputs: list[Path] | list[tuple[Path, str]],
    steps: list[Step],
    out: Path,
    tasks: int = 1,
    workers: int = 1,
    log=print,
    run_tasks: TaskRunner | None = None,
    read_options: dict | None = None,
) -> dict:
    """Run `steps` over `inputs` into `out`; finished tasks of an earlier attempt are kept.

    `inputs` are files, or (file, stable name) pairs as kiln.data.readers.list_named_inputs gives,
    optionally with a third item, the file's kiln.data.fields.FieldMap; the name prefixes default
    document ids, so it must not depend on where the data is mounted.
    `run_tasks` executes one phase's pending tasks (default: local worker processes); the Ray
    executor passes its own, and everything else (phases, markers, resolve, stats) stays here.
    `read_options` are keywords of kiln.data.readers.read_documents (`html_extractor`).
    """
    run_tasks = run_tasks or local_task_runner(workers)
    out, shards = prepare_output(inputs, out, tasks)
    phases = split_phases(steps)
    phases[0].read_options = dict(read_options or {})
    started = time.perf_counter()
    for phase in phases:
        pending = pending_tasks(out, phase, tasks)
        if len(pending) < tasks:
            log(f"[data] phase {phase.index}: {tasks - len(pending)} of {tasks} tasks already done, skipping them")
        if pending:
            run_tasks(phase, pending, shards, out, phase is phases[-1])
        resolve_phase(out, phase, tasks)
    stats = merge_stats(out, phases, tasks)
    stats["seconds"] = round(time.perf_counter() - started, 2)
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def prepare_output(inputs: list, out: Path, tasks: int) -> tuple[Path, list[list[tuple]]]:
    """The absolute output folder, made ready, and each task's shard of (absolute file, name, ...)."""
    # Absolute paths: tasks may run in other working directories (other processes, other nodes).
    out = Path(out).absolute()
    for folder in ("docs", "rejected", "work"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    named = [
        (Path(p[0]).absolute(), *p[1:]) if isinstance(p, tuple) else (Path(p).absolute(), Path(p).name) for p in inputs
    ]
    return out, assign_inputs(named, tasks)


def task_done(out: Path, phase: int, task: int) -> bool:
    return (out / "work" / f"phase-{phase}" / f"done-{task:05d}").exists()


def pending_tasks(out: Path, phase: Phase, tasks: int) -> list[int]:
    """The phase's tasks without a completion marker (and its work folder, made ready)."""
    (out / "work" / f"phase-{phase.index}").mkdir(exist_ok=True)
    return [t for t in range(tasks) if not task_done(out, phase.index, t)]


def resolve_phase(out: Path, phase: Phase, tasks: int) -> None:
    """A deduplicating phase's global decision, once, after all its tasks: it reads only the index
    files the tasks wrote, never the text. Nothing to do for other phases or when already resolved."""
    dedup = out / "work" / f"phase-{phase.index}" / "dedup"
    if phase.dedup is not None and not (dedup / "resolved.json").exists():
        _write_jsonl_atomic(dedup / "resolved.json", [phase.dedup.resolve(dedup, tasks)])


def merge_stats(out: Path, phases: list[Phase], tasks: int) -> dict:
    """Per-step totals over tasks, in pipeline order, plus each deduplicator's resolve stats.

    Steps are matched by position, not name, so a step used twice (normalize before and after an
    edit, say) keeps two rows. A deduplicator's filter row is the first of the next phase, and its
    resolve stats (numbers only) are added to that row's counters."""
    merged: dict[tuple[int, int], StepStats] = {}
    for phase in phases:
        work = out / "work" / f"phase-{phase.index}"
        for t in range(tasks):
            for position, entry in enumerate(json.loads((work / f"stats-{t:05d}.json").read_text())):
                stats = StepStats.from_dict(entry)
                merged.setdefault((phase.index, position), StepStats(stats.name)).merge(stats)
        resolved = work / "dedup" / "resolved.json"
        if phase.dedup is not None and resolved.exists():
            row = merged.setdefault((phase.index + 1, 0), StepStats(phase.dedup.name))
            for key, value in json.loads(resolved.read_text().splitlines()[0]).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    row.counters[key] += value
    steps = [merged[key].to_dict() for key in sorted(merged)]
    first = steps[0] if steps else None
    docs_in = sum(first["reasons"].values()) + first["docs_out"] if first and first["name"] == "read" else None
    return {
        "docs_in": docs_in,
        "docs_out": steps[-1]["docs_out"] if steps else 0,
        "bytes_out": steps[-1]["bytes_out"] if steps else 0,
        "tasks": tasks,
        "steps": steps,
    }


__all__ = [
    "run_pipeline",
    "run_task",
    "local_task_runner",
    "split_phases",
    "merge_stats",
    "prepare_output",
    "pending_tasks",
    "resolve_phase",
    "task_done",
]
