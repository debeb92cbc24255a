"""The Slurm executor: its scripts, its dependency chain (against a stand-in sbatch), and its array
tasks run here in-process, which must give the local executor's documents and funnel exactly."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kiln_testing.curation import make_inputs, read_folder, without_seconds

from kiln.cli import main
from kiln.config import build
from kiln.data.config import CurateConfig
from kiln.data.curate import curate, input_files
from kiln.data.slurm_executor import SLURM_DIR, array_tasks, plan_jobs
from kiln.data.slurm_task import task
from kiln.errors import ConfigError, DataError

BASH = shutil.which("bash")
STEPS = ["normalize", "exact_dedup", "minhash_dedup", "pii"]  # two deduplicators: three phases


def config(inputs, **slurm) -> CurateConfig:
    table = {
        "inputs": [str(p) for p in inputs[:-1]] + [{"path": str(inputs[-1]), "text_key": "text"}],
        "steps": STEPS,
        "tasks": 5,
        "executor": "slurm",
        "slurm": {"tasks_per_job": 2, "max_array_size": 2, "partition": "cpu", "time": "1:00:00", **slurm},
    }
    cfg = build(CurateConfig, table, "data")
    cfg.validate()
    return cfg


def local_run(inputs, out: Path) -> dict:
    cfg = config(inputs)
    cfg.executor, cfg.slurm = "local", type(cfg.slurm)()
    cfg.workers = 1
    return curate(cfg, out, log=lambda _: None)


def run_script(script: Path, monkeypatch, array_index=None, offset="0", python="python") -> None:
    """What Slurm would run: the script's `exec` line, here in-process, SLURM_ARRAY_TASK_ID set."""
    words = shlex.split(next(line for line in script.read_text().splitlines() if line.startswith("exec ")))
    assert words[1:4] == [python, "-m", "kiln.data.slurm_task"]
    argv = [offset if w == "${1:-0}" else w for w in words[4:]]
    if array_index is None:
        monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    else:
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(array_index))
    assert task(argv) == 0


def run_jobs(jobs, monkeypatch, python="python") -> None:
    """Every submission in order; an array job's tasks one by one."""
    for _, _, args in jobs:
        if args[0].startswith("--array="):
            for index in args[0].removeprefix("--array=").split(","):
                run_script(Path(args[1]), monkeypatch, int(index), offset=args[2], python=python)
        else:
            run_script(Path(args[0]), monkeypatch, python=python)


def jobs_of(submit: Path) -> list:
    """The submissions submit.sh makes, as plan_jobs lists them (dependencies left out)."""
    jobs = []
    for line in submit.read_text().splitlines():
        if "=$(sbatch --parsable " in line:
            words = shlex.split(line.split("=$(sbatch --parsable ", 1)[1].removesuffix(")"))
            jobs.append((None, None, [w for w in words if not w.startswith("--dependency")]))
    return jobs


def test_array_tasks_run_here_match_the_local_executor(tmp_path, monkeypatch, capsys):
    inputs = make_inputs(tmp_path / "in", files=5)
    local = local_run(inputs, tmp_path / "local")
    out = tmp_path / "slurm"
    cfg = config(inputs, dry_run=True)
    assert curate(cfg, out) is None  # dry run: nothing submitted, nothing curated yet
    printed = capsys.readouterr().out
    assert "sbatch --parsable --array=0,1 " in printed and not (out / "stats.json").exists()
    jobs = plan_jobs(cfg, input_files(cfg), out)
    # 5 tasks, 2 per array task: indices 0-2 per phase; max_array_size 2 splits them into two arrays.
    assert [(job, args[0]) for job, _, args in jobs if args[0].startswith("--array")] == [
        (f"phase-{p}{suffix}", spec) for p in range(3) for suffix, spec in (("", "--array=0,1"), ("-2", "--array=0"))
    ]
    run_jobs(jobs, monkeypatch)

    assert read_folder(out / "docs") == read_folder(tmp_path / "local" / "docs")
    assert read_folder(out / "rejected") == read_folder(tmp_path / "local" / "rejected")
    stats = json.loads((out / "stats.json").read_text())  # written by the finish job
    assert without_seconds(stats) == without_seconds(local)
    by_step = {s["name"]: s for s in stats["steps"]}
    assert by_step["exact_dedup"]["reasons"]["exact_duplicate"] > 0 and (out / "funnel.html").exists()
    # Everything is done: the next `kiln data` submits nothing and returns the finished run's stats.
    assert without_seconds(curate(cfg, out)) == without_seconds(local)


def test_resubmission_redoes_only_unfinished_tasks(tmp_path, monkeypatch):
    inputs = make_inputs(tmp_path / "in", files=5)
    local_run(inputs, tmp_path / "local")
    out = tmp_path / "slurm"
    cfg = config(inputs, dry_run=True)
    files = input_files(cfg)
    jobs = plan_jobs(cfg, files, out)
    run_jobs(jobs[:2], monkeypatch)  # phase 0's two arrays: tasks 0-4
    phase0 = out / "work" / "phase-0"
    (phase0 / "done-00001").unlink()  # task 1 "was killed" before its marker
    (phase0 / "done-00004").unlink()
    kept = phase0 / "part-00000.jsonl"
    mtime = kept.stat().st_mtime_ns

    # The resubmitted arrays cover only the array tasks with work left: index 0 (task 1), index 2 (task 4).
    again = plan_jobs(cfg, files, out)
    assert [args[0] for job, _, args in again if job.startswith("phase-0")] == ["--array=0", "--array=0"]
    assert [job for job, _, _ in again][:3] == ["phase-0", "phase-0-2", "resolve-0"]
    # An array task whose tasks have markers skips them: index 0 runs task 1 and skips task 0.
    assert array_tasks(out, 0, 0) == (1, 1)
    assert array_tasks(out, 0, 0) == (0, 2)
    assert kept.stat().st_mtime_ns == mtime
    run_jobs(plan_jobs(cfg, files, out), monkeypatch)
    assert read_folder(out / "docs") == read_folder(tmp_path / "local" / "docs")


def fake_sbatch(tmp_path: Path) -> dict:
    """An sbatch that records its arguments (one call per line) and prints the next job id."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "sbatch").write_text(
        textwrap.dedent("""\
        #!/bin/sh
        n=$(( $(cat "$STUB_DIR/next" 2>/dev/null || echo 100) + 1 ))
        echo "$n" > "$STUB_DIR/next"
        echo "$*" >> "$STUB_DIR/sbatch.log"
        echo "$n;cluster-a"
        """)
    )
    (stubs / "sbatch").chmod(0o755)
    return {"PATH": f"{stubs}:{os.environ['PATH']}", "STUB_DIR": str(tmp_path)}


def dependency_chain(log: Path) -> list[tuple[str, str]]:
    """(script name, afterok ids) per sbatch call, in order."""
    calls = []
    for line in log.read_text().splitlines():
        script = re.search(r"(\S+)\.sbatch", line).group(1).rsplit("/", 1)[-1]
        dep = re.search(r"--dependency=afterok:(\S+)", line)
        assert line.startswith("--parsable")
        calls.append((script, dep.group(1) if dep else ""))
    return calls


EXPECTED_CHAIN = [
    ("phase-0", ""),
    ("phase-0", ""),
    ("resolve-0", "101:102"),
    ("phase-1", "103"),
    ("phase-1", "103"),
    ("resolve-1", "104:105"),
    ("phase-2", "106"),
    ("phase-2", "106"),
    ("finish", "107:108"),
]


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_submission_chains_phases_with_afterok(tmp_path, monkeypatch):
    inputs = make_inputs(tmp_path / "in", files=5)
    env = fake_sbatch(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("STUB_DIR", env["STUB_DIR"])
    out = tmp_path / "slurm"
    assert curate(config(inputs), out, log=lambda _: None) is None
    assert dependency_chain(tmp_path / "sbatch.log") == EXPECTED_CHAIN
    # submit.sh, the dry run's way to submit, makes the same calls with the same chain.
    (tmp_path / "sbatch.log").unlink()
    (tmp_path / "next").unlink()
    script = out / "work" / SLURM_DIR / "submit.sh"
    result = subprocess.run([BASH, str(script)], env={**os.environ, **env}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "finish: 109" in result.stdout
    assert dependency_chain(tmp_path / "sbatch.log") == EXPECTED_CHAIN


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_sbatch_scripts_pass_bash_n_and_carry_the_options(tmp_path):
    inputs = make_inputs(tmp_path / "in", files=2)
    cfg = config(
        inputs,
        dry_run=True,
        account="proj",
        qos="low",
        mem="4G",
        cpus_per_task=2,
        sbatch_args=["--constraint=cpu"],
        setup=["source .venv/bin/activate"],
        python=".venv/bin/python -X utf8",
    )
    out = tmp_path / "slurm"
    curate(cfg, out, log=lambda _: None)
    folder = out / "work" / SLURM_DIR
    scripts = sorted(folder.glob("*.sbatch"))
    assert [s.name for s in scripts] == [
        "finish.sbatch",
        "phase-0.sbatch",
        "phase-1.sbatch",
        "phase-2.sbatch",
        "resolve-0.sbatch",
        "resolve-1.sbatch",
    ]
    for script in [*scripts, folder / "submit.sh"]:
        result = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"
    for script in scripts:
        lines = script.read_text().splitlines()
        assert lines[0] == "#!/bin/bash"
        directives = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH")]
        first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
        assert all(lines.index(f"#SBATCH {d}") < first_command for d in directives)  # sbatch stops there
        assert {
            "--partition=cpu",
            "--account=proj",
            "--qos=low",
            "--time=1:00:00",
            "--mem=4G",
            "--cpus-per-task=2",
            "--constraint=cpu",
            f"--job-name=kiln-data-{script.stem}",
        } <= set(directives)
        assert lines.index("source .venv/bin/activate") < next(i for i, line in enumerate(lines) if "exec " in line)
    phase = (folder / "phase-1.sbatch").read_text()
    assert f"exec .venv/bin/python -X utf8 -m kiln.data.slurm_task {out} --phase 1 --offset" in phase
    assert f"--output={folder}/logs/phase-1-%A_%a.out" in phase


@pytest.mark.parametrize(
    "table, key",
    [
        ({"executor": "local", "slurm": {"partition": "cpu"}}, "data.slurm"),
        ({"executor": "slurm", "ray_address": "auto"}, "data.ray_address"),
        ({"executor": "slurm", "slurm": {"time": "two days"}}, "data.slurm.time"),
        ({"executor": "slurm", "slurm": {"tasks_per_job": 0}}, "data.slurm.tasks_per_job"),
        ({"executor": "slurm", "slurm": {"sbatch_args": ["-p x"]}}, "data.slurm.sbatch_args[0]"),
        ({"executor": "slurm", "slurm": {"colour": "red"}}, "data.slurm.colour"),
    ],
)
def test_refused_options(table, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        cfg = build(CurateConfig, table, "data")
        try:
            cfg.validate()
        except ConfigError as err:
            raise err.within("data") from None


def test_kiln_data_dry_run_then_finish(tmp_path, monkeypatch, capsys):
    inputs = make_inputs(tmp_path / "in", files=2)
    args = [
        "data",
        "recipes/tiny.toml",
        f'run.out_dir="{tmp_path}"',
        "run.name=cur",
        f'data.inputs=["{inputs[0]}", "{inputs[1]}"]',
        'data.steps=["normalize", "exact_dedup", "pii"]',
        "data.tasks=2",
        'data.executor="slurm"',
        "data.slurm.dry_run=true",
        f'data.slurm.python="{sys.executable}"',
    ]
    assert main(args) == 0
    out = tmp_path / "cur" / "data"
    assert "submit with `bash" in capsys.readouterr().out and not (out / "DONE").exists()
    jobs = jobs_of(out / "work" / SLURM_DIR / "submit.sh")
    # The first array task as Slurm runs it: the script itself, in bash, in a process of its own.
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    result = subprocess.run([BASH or "bash", jobs[0][2][1], "0"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "phase 0: 1 task(s) run, 0 already done" in result.stdout
    assert (out / "work" / "phase-0" / "done-00001").exists() and not (out / "work" / "phase-0" / "done-00000").exists()
    run_jobs(jobs, monkeypatch, python=sys.executable)
    # The jobs ran (here, in-process): the same command finds them done and finishes the stage.
    assert main(args) == 0
    assert "continuing the Slurm run" in capsys.readouterr().out
    assert json.loads((out / "DONE").read_text())["stats"]["docs_out"] > 0


def test_jobs_refuse_what_slurm_would_not_run(tmp_path, monkeypatch, capsys):
    inputs = make_inputs(tmp_path / "in", files=2)
    out = tmp_path / "slurm"
    cfg = config(inputs, dry_run=True)
    curate(cfg, out, log=lambda _: None)
    # A resolve started by hand before its phase finished must not decide on half the documents.
    assert task([str(out), "--resolve", "0"]) == 2
    assert "phase 0 has 5 unfinished tasks (first: 0)" in capsys.readouterr().err
    assert not (out / "work" / "phase-0" / "dedup" / "resolved.json").exists()
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    assert task([str(out), "--phase", "0"]) == 2
    assert "SLURM_ARRAY_TASK_ID is not set" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert task([str(out), "--phase", "0"]) == 2
    assert "array task 3 is past the 5 tasks" in capsys.readouterr().err
    assert task([str(tmp_path), "--finish"]) == 2 and "no Slurm plan here" in capsys.readouterr().err
    # Another recipe into the same folder is refused instead of mixing two runs' tasks.
    cfg.steps = ["normalize", "pii"]
    with pytest.raises(DataError, match="holds a Slurm run of other steps"):
        curate(cfg, out, log=lambda _: None)
