"""Run the same curation pipeline as kiln.data.executor, with each task a Ray core task.

Nothing about the pipeline changes: the same phases (`split_phases`), the same `run_task` for every
(phase, task), the same part files, completion markers, dedup `resolve` and `merge_stats`. Ray only
replaces the process pool, so a pipeline can be developed on a laptop with the local executor and
run across a cluster by switching `[data] executor = "ray"`, and a run started with one executor can
be resumed with the other.

Why Ray core tasks and not Ray Data: a task here is a whole shard that reads and writes its own
files, which is exactly a remote function call; Ray Data would split shards into blocks and add a
per-block scheduling cost that dominates on the small inputs Kiln tests with.

Every node must see the output folder at the same path (a shared filesystem: NFS, a mounted bucket),
because tasks write their parts and markers there and the driver's `resolve` reads the dedup indexes
every task wrote. This is checked: the driver writes a random token into the output folder and each
task reads it back before doing any work.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from kiln.data.executor import Phase, run_pipeline, run_task
from kiln.data.steps.base import Step
from kiln.errors import DataError

PROBE = "ray-probe"  # file in <out>/work holding the driver's token; tasks compare it with theirs


def _local_cores() -> int:
    # The cores this process may use (a container or taskset can allow fewer than the machine has).
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _checked_run_task(phase: Phase, task: int, shards: list, out: Path, final: bool, token: str) -> int:
    """run_task, after making sure this node sees the driver's output folder and not a local copy."""
    probe = out / "work" / PROBE
    seen = probe.read_text() if probe.exists() else None
    if seen != token:
        raise DataError(
            f"{out}: the output folder on node {socket.gethostname()} is not the driver's "
            f"(probe {'missing' if seen is None else 'differs'}); put it on a filesystem every "
            f"Ray node mounts at the same path (NFS, a mounted bucket)"
        )
    run_task(phase, task, shards, out, final)
    return task


def _start_ray(address: str | None):
    """Connect to `address`, or start Ray on this machine; returns (ray, whether we started it)."""
    try:
        import ray
    except ImportError:
        raise ImportError("the ray executor needs Ray: pip install 'kiln[ray]'") from None
    if ray.is_initialized():
        return ray, False  # the caller set Ray up (runtime_env, namespace...): use it as it is
    if address:
        # "auto", "host:6379" (join as a driver on a cluster node) or "ray://host:10001" (Ray Client).
        # Resources are the cluster's own, so num_cpus must not be passed.
        ray.init(address=address, ignore_reinit_error=True)
    else:
        # "local", not None: None would silently join a cluster that `ray start` left running on this
        # machine (or RAY_ADDRESS), where passing num_cpus is an error.
        ray.init(address="local", num_cpus=_local_cores(), include_dashboard=False, ignore_reinit_error=True)
    return ray, True


def run_pipeline_ray(
    inputs: list[Path] | list[tuple[Path, str]],
    steps: list[Step],
    out: Path,
    tasks: int = 1,
    address: str | None = None,
    log=print,
    read_options: dict | None = None,
) -> dict:
    """kiln.data.executor.run_pipeline on Ray: one Ray task per (phase, task), one CPU each.

    `address`: None or "" starts Ray on this machine with all its cores; "auto", "host:port" or
    "ray://host:10001" joins an existing cluster. If Ray is already initialised in this process it
    is used as it is (set up `ray.init(runtime_env=...)` yourself for anything special). Ray is shut
    down at the end only if this call started it. Finished tasks of an earlier attempt (by either
    executor) are kept; the first failed task's error is raised after the phase's other tasks end.
    """
    out = Path(out).absolute()  # workers start in their own directories; a relative path would differ
    (out / "work").mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    (out / "work" / PROBE).write_text(token)
    ray, started_ray = _start_ray(address)
    try:
        # Default retries are kept: a task lost with its node is rerun, which is safe because a task
        # writes only its own files, each atomically, and its marker last. Exceptions are not retried.
        remote_task = ray.remote(num_cpus=1)(_checked_run_task)
        log(f"[data] ray: {int(ray.cluster_resources().get('CPU', 0))} CPUs on {len(ray.nodes())} node(s)")

        def run_tasks(phase: Phase, pending: list[int], shards: list, out: Path, final: bool) -> None:
            phase_ref = ray.put(phase)  # the steps are shipped once per phase, not once per task
            running = [remote_task.remote(phase_ref, t, shards[t], out, final, token) for t in pending]
            failures = []
            while running:
                # Wait for every task even after a failure, so a rerun has as little left to redo.
                ready, running = ray.wait(running, num_returns=1)
                try:
                    ray.get(ready[0])
                except Exception as err:  # a RayTaskError that is also an instance of the task's error
                    failures.append(err)
            if failures:
                log(f"[data] phase {phase.index}: {len(failures)} of {len(pending)} tasks failed")
                raise failures[0]

        return run_pipeline(inputs, steps, out, tasks=tasks, log=log, run_tasks=run_tasks, read_options=read_options)
    finally:
        if started_ray:
            ray.shutdown()


__all__ = ["run_pipeline_ray"]
