"""Run the curation pipeline of kiln.data.executor as Slurm job arrays, one array task per shard.

The same phases (`split_phases`), the same `run_task` for every (phase, task), the same part files,
completion markers, dedup `resolve` and `merge_stats` as the local and Ray executors: only who runs
a task changes, so the documents and the funnel are the same as a local run's.

What is submitted, each job waiting for the one before it with `--dependency=afterok:<id>`:
    phase-0 array (one array task per `tasks_per_job` shards; several arrays when a phase has more
    than `max_array_size` of them) -> resolve-0 (a phase that ends in a deduplicator) -> phase-1 array
    -> ... -> finish (merges the per-task stats into stats.json and draws the funnel).

An array task whose curation task already has its marker exits 0 at once, so resubmitting after a
failure (or a time limit) redoes only the unfinished tasks; phases that are done entirely are not
submitted at all. Everything a task needs is in <out>/work/slurm/plan.json (the steps, their
parameters and the input files), written at submission, so the nodes never read the recipe; the
output folder must be on a filesystem every node mounts at the same path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
from pathlib import Path

from kiln.data.config import CurateConfig, SlurmDataOptions
from kiln.data.executor import Phase, merge_stats, pending_tasks, prepare_output, resolve_phase, run_task, split_phases
from kiln.data.fields import FieldMap
from kiln.errors import DataError

SLURM_DIR = "slurm"  # under <out>/work: the plan, the sbatch scripts, submit.sh and the job logs


def _plan(cfg: CurateConfig, files: list[tuple]) -> dict:
    return {
        "steps": list(cfg.steps),
        "params": cfg.params,
        "html_extractor": cfg.html_extractor,
        "tasks": cfg.tasks,
        "tasks_per_job": cfg.slurm.tasks_per_job,
        "files": [
            [str(Path(path).absolute()), name, dataclasses.asdict(fields) if fields else None]
            for path, name, *rest in files
            for fields in [rest[0] if rest else None]
        ],
    }


def load_plan(out: Path) -> tuple[CurateConfig, list[Phase], list[list[tuple]], dict]:
    """What an array task runs: (config, phases, each task's shard, the plan) from plan.json."""
    path = Path(out) / "work" / SLURM_DIR / "plan.json"
    if not path.exists():
        raise DataError(f'{path}: no Slurm plan here; `kiln data` with executor = "slurm" writes it')
    plan = json.loads(path.read_text())
    cfg = CurateConfig(
        steps=plan["steps"], params=plan["params"], tasks=plan["tasks"], html_extractor=plan["html_extractor"]
    )
    files = [(Path(p), name, FieldMap(**fields) if fields else None) for p, name, fields in plan["files"]]
    _, shards = prepare_output(files, out, cfg.tasks)
    phases = split_phases(cfg.build_steps())
    phases[0].read_options = {"html_extractor": cfg.html_extractor}  # as run_pipeline's read: WARC inputs
    return cfg, phases, shards, plan


def array_tasks(out: Path, phase_index: int, array_index: int) -> tuple[int, int]:
    """Run the curation tasks of one array task of one phase; returns (ran, skipped: marker found)."""
    out = Path(out).absolute()
    cfg, phases, shards, plan = load_plan(out)
    if not 0 <= phase_index < len(phases):
        raise DataError(f"{out}: phase {phase_index} does not exist; the plan has {len(phases)} phases")
    phase = phases[phase_index]
    per_job = plan["tasks_per_job"]
    first = array_index * per_job
    if not 0 <= first < cfg.tasks:
        raise DataError(f"{out}: array task {array_index} is past the {cfg.tasks} tasks of the plan")
    pending = set(pending_tasks(out, phase, cfg.tasks))
    ran = skipped = 0
    for task in range(first, min(first + per_job, cfg.tasks)):
        if task not in pending:
            skipped += 1
            continue
        run_task(phase, task, shards[task], out, phase is phases[-1])
        ran += 1
    return ran, skipped


def resolve(out: Path, phase_index: int) -> None:
    """The barrier job after a deduplicating phase: its one global `resolve`."""
    out = Path(out).absolute()
    cfg, phases, _, _ = load_plan(out)
    missing = pending_tasks(out, phases[phase_index], cfg.tasks)
    if missing:  # afterok makes this unreachable under Slurm; a hand-run job must not resolve half
        raise DataError(f"{out}: phase {phase_index} has {len(missing)} unfinished tasks (first: {missing[0]})")
    resolve_phase(out, phases[phase_index], cfg.tasks)


def merged_stats(out: Path) -> dict:
    out = Path(out).absolute()
    cfg, phases, _, _ = load_plan(out)
    for phase in phases:
        missing = pending_tasks(out, phase, cfg.tasks)
        if missing:
            raise DataError(f"{out}: phase {phase.index} has {len(missing)} unfinished tasks (first: {missing[0]})")
    return merge_stats(out, phases, cfg.tasks)


def _script(opts: SlurmDataOptions, name: str, log_dir: Path, command: list[str], array: bool) -> str:
    directives = [f"--job-name={opts.job_name}-{name}", "--ntasks=1", f"--cpus-per-task={opts.cpus_per_task}"]
    if opts.mem:
        directives.append(f"--mem={opts.mem}")
    for flag in ("partition", "account", "qos", "time"):
        if getattr(opts, flag):
            directives.append(f"--{flag}={getattr(opts, flag)}")
    # %A_%a: one log per array task (array job id, task id); %j for the single jobs.
    directives.append(f"--output={log_dir}/{name}-{'%A_%a' if array else '%j'}.out")
    directives += opts.sbatch_args
    body = " ".join(shlex.quote(w) for w in command)
    if array:
        # The array's first index in the phase: a phase bigger than max_array_size is several arrays.
        body += ' --offset "${1:-0}"'
    return "\n".join(
        [
            "#!/bin/bash",
            f'# Kiln curation, {name}: written by `kiln data` (executor = "slurm"); submitted by submit.sh.',
            *[f"#SBATCH {d}" for d in directives],
            "",
            "set -eu",
            *opts.setup,
            "",
            f"exec {body}",
            "",
        ]
    )


def plan_jobs(cfg: CurateConfig, files: list[tuple], out: Path) -> list[tuple[str, list[str], list[str]]]:
    """Write plan.json and the sbatch scripts; return the submissions in order, each
    (name, names of the jobs it waits for, sbatch arguments after `sbatch --parsable`)."""
    out, _ = prepare_output(files, out, cfg.tasks)
    folder = out / "work" / SLURM_DIR
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    plan = _plan(cfg, files)
    plan_path = folder / "plan.json"
    if plan_path.exists() and json.loads(plan_path.read_text()) != plan:
        raise DataError(
            f"{plan_path}: this output folder holds a Slurm run of other steps, inputs or tasks; "
            "remove the folder (or run with --force) to start again"
        )
    plan_path.write_text(json.dumps(plan, indent=2))
    opts = cfg.slurm
    task = [*shlex.split(opts.python), "-m", "kiln.data.slurm_task", str(out)]
    phases = split_phases(cfg.build_steps())
    jobs, previous = [], []
    per_job = opts.tasks_per_job
    for phase in phases:
        pending = pending_tasks(out, phase, cfg.tasks)
        arrays = sorted({t // per_job for t in pending})  # array indices with work left
        name = f"phase-{phase.index}"
        script = folder / f"{name}.sbatch"
        script.write_text(_script(opts, name, folder / "logs", [*task, "--phase", str(phase.index)], array=True))
        current = []
        for start in range(0, max(arrays) + 1 if arrays else 0, opts.max_array_size):
            chunk = [a - start for a in arrays if start <= a < start + opts.max_array_size]
            if chunk:
                job = f"{name}-{start}" if start else name
                spec = ",".join(map(str, chunk))
                jobs.append((job, previous, [f"--array={spec}", str(script), str(start)]))
                current.append(job)
        previous = current or previous
        if phase.dedup is not None:
            name = f"resolve-{phase.index}"
            script = folder / f"{name}.sbatch"
            script.write_text(_script(opts, name, folder / "logs", [*task, "--resolve", str(phase.index)], array=False))
            if current or not (out / "work" / f"phase-{phase.index}" / "dedup" / "resolved.json").exists():
                jobs.append((name, previous, [str(script)]))
                previous = [name]
    script = folder / "finish.sbatch"
    script.write_text(_script(opts, "finish", folder / "logs", [*task, "--finish"], array=False))
    jobs.append(("finish", previous, [str(script)]))
    return jobs


def _var(job: str) -> str:
    return "job_" + job.replace("-", "_")


def submit_script(jobs: list[tuple[str, list[str], list[str]]]) -> str:
    """The same submissions as a shell script: each job id kept in a variable for the next ones."""
    lines = ["#!/bin/bash", "# Submits the Kiln curation jobs in order; written by `kiln data`.", "set -eu"]
    for job, after, args in jobs:
        dep = [f"--dependency=afterok:{':'.join('${' + _var(a) + '%%;*}' for a in after)}"] if after else []
        words = " ".join([*dep, *(shlex.quote(a) for a in args)])
        lines.append(f"{_var(job)}=$(sbatch --parsable {words})")
        lines.append(f'echo "{job}: ${{{_var(job)}%%;*}}"')
    return "\n".join(lines) + "\n"


def submit(jobs: list[tuple[str, list[str], list[str]]], log=print) -> dict[str, str]:
    """Run `sbatch --parsable` for each job in order, each with the ids of the jobs it waits for."""
    ids: dict[str, str] = {}
    for job, after, args in jobs:
        dep = [f"--dependency=afterok:{':'.join(ids[a] for a in after)}"] if after else []
        argv = ["sbatch", "--parsable", *dep, *args]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise DataError("sbatch: not found; run on a Slurm login node, or set data.slurm.dry_run=true") from None
        if result.returncode != 0:
            raise DataError(f"sbatch {job}: exit {result.returncode}: {result.stderr.strip() or result.stdout.strip()}")
        ids[job] = result.stdout.strip().split(";")[0]  # --parsable: "<id>" or "<id>;<cluster>"
        log(f"[data] slurm: {job} submitted as job {ids[job]}")
    return ids


def run_pipeline_slurm(cfg: CurateConfig, files: list[tuple], out: Path, log=print) -> dict | None:
    """Plan and submit (or, with dry_run, only write) the jobs; the merged stats when nothing is left
    to run (every task and resolve of an earlier submission done), else None: the jobs will finish."""
    jobs = plan_jobs(cfg, files, out)
    folder = Path(out).absolute() / "work" / SLURM_DIR
    (folder / "submit.sh").write_text(submit_script(jobs))
    if [job for job, _, _ in jobs] == ["finish"]:
        return merged_stats(out)
    if cfg.slurm.dry_run:
        log(f"[data] slurm dry run: scripts in {folder}; submit with `bash {folder / 'submit.sh'}`:")
        log(submit_script(jobs).rstrip())
        return None
    submit(jobs, log)
    return None


def array_index(offset: int) -> int:
    """This array task's index in its phase: the array's offset plus SLURM_ARRAY_TASK_ID."""
    value = os.environ.get("SLURM_ARRAY_TASK_ID", "")
    if not value.isdigit():
        raise DataError("SLURM_ARRAY_TASK_ID is not set: --phase runs inside a Slurm array job")
    return offset + int(value)


__all__ = [
    "run_pipeline_slurm",
    "plan_jobs",
    "submit",
    "submit_script",
    "array_tasks",
    "resolve",
    "merged_stats",
    "array_index",
]
