"""A watchdog that ends a training process whose step (or checkpoint save) hangs.

A hung collective (one rank died or a link went down), a stuck file system or a deadlocked data
worker leaves a job waiting forever while it holds its devices. The trainer arms the watchdog around
each step, validation and checkpoint save; if one does not finish within its timeout, a daemon
thread writes a diagnostic (stage folder, step, what was running, every thread's Python stack) to
stderr and `<out>/watchdog.txt`, appends an event to `<out>/metrics.jsonl`, and exits the process
with WATCHDOG_EXIT_CODE so the launcher (torchrun --max-restarts, Slurm --requeue, a Kubernetes
restart policy) starts the job again, which resumes from its last complete checkpoint.

`os._exit` rather than an exception: the main thread is blocked inside the hung call and would
never see one, and atexit handlers or a distributed shutdown could hang the same way.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

WATCHDOG_EXIT_CODE = 3


class Watchdog:
    def __init__(
        self,
        timeout_s: float,
        out_dir,
        rank: int = 0,
        log_metrics: bool = True,
        on_timeout: Callable[[str], None] | None = None,
    ):
        """timeout_s <= 0 disables it (no thread). After the diagnostic is written, `on_timeout(text)`
        runs in the watchdog thread; the default exits the process with WATCHDOG_EXIT_CODE."""
        self.timeout_s = timeout_s
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.log_metrics = log_metrics
        self.on_timeout = on_timeout or self._exit
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._what, self._step, self._armed_for = "", 0, 0.0
        self._closed = False
        self.fired = False
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._run, name="kiln-watchdog", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    def arm(self, what: str, step: int, timeout_s: float | None = None) -> None:
        if not self.enabled:
            return
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        with self._cond:
            self._what, self._step, self._armed_for = what, step, timeout
            self._deadline = time.monotonic() + timeout
            self._cond.notify()

    def disarm(self) -> None:
        if not self.enabled:
            return
        with self._cond:
            self._deadline = None
            self._cond.notify()

    @contextmanager
    def watch(self, what: str, step: int, timeout_s: float | None = None):
        self.arm(what, step, timeout_s)
        try:
            yield
        finally:
            self.disarm()

    def close(self) -> None:
        if not self.enabled:
            return
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._closed:
                    return
                if self._deadline is None:
                    self._cond.wait()
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    what, step, armed_for = self._what, self._step, self._armed_for
                    break
                self._cond.wait(remaining)
        self.fired = True
        text = self.diagnostic(what, step, armed_for)
        try:
            # stderr first: it needs no file system, which may be what hangs.
            sys.stderr.write(text)
            sys.stderr.flush()
            self._write_files(text, what, step, armed_for)
        finally:
            self.on_timeout(text)

    def diagnostic(self, what: str, step: int, armed_for: float) -> str:
        header = (
            f"kiln watchdog: no progress for {armed_for:g} s\n"
            f"stage: {self.out_dir.resolve()}\nrank: {self.rank}\npid: {os.getpid()}\n"
            f"step: {step}\nwhat: {what}\ntime: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
            f"exit code: {WATCHDOG_EXIT_CODE} (the launcher should restart the job; it resumes from "
            f"the last complete checkpoint)\n\nstacks of every thread, most recent call first:\n"
        )
        # faulthandler walks every thread's frames, including those of a thread blocked inside C
        # code (a collective, a read), and writes them unbuffered to a file descriptor.
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            return header + f.read()

    def _write_files(self, text: str, what: str, step: int, armed_for: float) -> None:
        name = "watchdog.txt" if self.rank == 0 else f"watchdog-rank{self.rank}.txt"
        path = self.out_dir / name
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if self.log_metrics:
            record = {
                "kind": "event",
                "step": step,
                "type": "watchdog",
                "what": what,
                "timeout_s": armed_for,
                "diagnostic": str(path),
            }
            # One write on an O_APPEND descriptor: the metrics logger of the hung main thread
            # flushes whole lines, so the record lands after its last complete one.
            fd = os.open(self.out_dir / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
            finally:
                os.close(fd)

    @staticmethod
    def _exit(diagnostic: str) -> None:
        os._exit(WATCHDOG_EXIT_CODE)
