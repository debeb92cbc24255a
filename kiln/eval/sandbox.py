"""Running untrusted Python (model-written code, its tests) in a child process that cannot hurt the
machine it runs on, and reporting how each run ended.

Each run gets a fresh temporary folder as its working directory (deleted afterwards) and a child
`python -I -B` started in a new session, so that the whole process group is killed at the end, on
a wall-clock timeout or not. Before the snippet runs, the child confines itself in layers:

1. resource limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), the largest file it may
   write (RLIMIT_FSIZE, also bounding its stdout/stderr, which go to files, not pipes), open files,
   no core dumps, and processes (RLIMIT_NPROC: 0 by default, so no fork and no thread succeeds);
2. a network namespace of its own with no interfaces (unshare(CLONE_NEWNET) as root, else a user
   namespace plus a network namespace where the kernel allows unprivileged ones);
3. when started by root: it becomes `nobody` (the folder is chowned to it) keeping only
   CAP_DAC_READ_SEARCH, so it can still read the Python installation (which may live under a
   private /root) but writes only where `nobody` may, and RLIMIT_NPROC applies (the kernel exempts
   root from it); no_new_privs is set so an exec can never gain privileges;
4. Landlock (Linux 5.13+, unprivileged): the kernel refuses every write, create, delete, rename,
   link and truncate outside the folder (/dev/null excepted), whoever the child runs as; with ABI 4
   also TCP bind/connect, with ABI 6 signals to processes outside the sandbox;
5. a Python audit hook (PEP 578, kiln.eval.sandbox_confine) that ends the run as "forbidden", naming
   what it stopped, on: a write, create (os.mkfifo/os.mknod included, which are replaced because
   they raise no event), rename, delete, chmod, link or truncate outside the folder (symlinks,
   dir_fd and descriptors resolved), opening a directory outside it, any socket call, starting a
   process (fork, exec, spawn, system, subprocess, and importing _posixsubprocess, whose fork_exec
   has no audit event), signalling other processes, raising resource limits, ctypes/cffi, and the
   gc/tracing calls that could reach the hook. The hook captures everything it calls before the
   snippet runs, so replacing os._exit, os.sep, os.path or builtins does not change it.

The parent enforces the folder quota (disk_mb): it measures the folder, plus the files the child
holds open that changed since it started (so the libraries it only reads do not count), every
DISK_POLL_S and kills the group when it is over.

What is not prevented, exactly: reading files (the snippet can read whatever the child's user can;
as `nobody` with CAP_DAC_READ_SEARCH that is every file); without Landlock, writes to world-writable
places such as /tmp (as `nobody`) or anywhere the caller may write (without root) once the audit
hook is bypassed (audit hooks are not a security boundary: code that reaches native memory could
disable it); chmod/chown/utime/xattr of the caller's own files outside the folder when the hook is
bypassed (Landlock does not cover them); with max_processes > 0 a grandchild that calls setsid()
leaves the process group and survives the final kill, and its open files are not counted in the
quota. `isolation` in each result says which layers were actually in force.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import ConfigError
from kiln.eval.sandbox_confine import FORBIDDEN_EXIT, MARK, confine, make_guard, replace_node_creation

STATUSES = ("ok", "error", "timeout", "memory", "forbidden", "killed")
MEMORY_EXIT, FILE_SIZE_EXIT = 118, 119
KILN_ROOT = str(Path(__file__).resolve().parents[2])
# The child imports this module by path (-I ignores PYTHONPATH and the user's site folder).
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); from kiln.eval.sandbox import _child_main; "
    "_child_main(sys.argv[2], int(sys.argv[3]))"
)
DISK_POLL_S = 0.05  # how often the parent measures the folder
ENTRY_BYTES = 4096  # the least each file or folder is charged in the quota


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: int | None = None  # CPU seconds; None: ceil(timeout_s) + 1, so the wall clock usually fires first
    memory_mb: int = 1024  # address space, which counts more than resident memory
    file_mb: int = 16  # largest file written, stdout and stderr included
    disk_mb: int = 64  # the folder plus the files the child holds open and changed, measured from outside
    max_processes: int = 0  # extra processes or threads the snippet may start
    max_open_files: int = 256
    network: bool = False  # True leaves the network namespace alone and allows sockets
    python_guard: bool = True  # the audit hook; False only to test the kernel layers on their own
    max_output: int = 64_000  # characters of stdout and of stderr kept in the result

    def validate(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", f"must be > 0, got {self.timeout_s}")
        if self.cpu_s is not None and self.cpu_s < 1:
            raise ConfigError("cpu_s", f"must be >= 1 (or None), got {self.cpu_s}")
        if self.memory_mb < 64:
            raise ConfigError("memory_mb", f"must be >= 64 (the interpreter alone needs ~30 MB), got {self.memory_mb}")
        for key in ("file_mb", "disk_mb", "max_open_files", "max_output"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.max_processes < 0:
            raise ConfigError("max_processes", f"must be >= 0, got {self.max_processes}")


@dataclass
class SandboxResult:
    status: str  # one of STATUSES
    returncode: int | None  # negative: killed by that signal
    stdout: str
    stderr: str
    detail: str = ""  # why, for every status but "ok"
    wall_s: float = 0.0
    cpu_s: float = 0.0
    pid: int = 0  # the child's pid, which was also its process group id
    isolation: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "ok"


def run_python(
    code: str, limits: Limits | None = None, files: dict[str, str] | None = None, stdin: str | None = None
) -> SandboxResult:
    """Run `code` as main.py in a fresh folder (with `files`, relative name -> text, beside it)."""
    import shutil
    import subprocess
    import tempfile

    limits = limits or Limits()
    limits.validate()
    root = Path(tempfile.mkdtemp(prefix="kiln-sandbox-"))
    private = Path(tempfile.mkdtemp(prefix="kiln-sandbox-io-"))
    try:
        (root / "main.py").write_text(code, encoding="utf-8")
        for name, text in (files or {}).items():
            target = (root / name).resolve()
            if not target.is_relative_to(root.resolve()) or target == root.resolve() / "main.py":
                raise ConfigError("files", f"{name!r} must be a relative path inside the folder, not main.py")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        drop = _unprivileged_ids()
        if drop is not None:
            for folder, dirs, names in os.walk(root):
                for p in [folder, *(os.path.join(folder, n) for n in dirs + names)]:
                    os.chown(p, *drop)
        cpu = limits.cpu_s if limits.cpu_s is not None else math.ceil(limits.timeout_s) + 1
        config = {
            "root": str(root),
            "kiln_root": KILN_ROOT,
            "cpu_s": cpu,
            "memory_mb": limits.memory_mb,
            "file_mb": limits.file_mb,
            "max_processes": limits.max_processes,
            "max_open_files": limits.max_open_files,
            "network": limits.network,
            "python_guard": limits.python_guard,
            "drop": drop,
        }
        (private / "config.json").write_text(json.dumps(config))
        stdin_path = private / "stdin"
        stdin_path.write_text(stdin or "", encoding="utf-8")
        # The child gets a bare environment: nothing of the caller's (tokens, proxies) leaks in.
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(root),
            "TMPDIR": str(root),
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        with (
            open(stdin_path, "rb") as inp,
            open(private / "stdout", "wb") as out,
            open(private / "stderr", "wb") as err,
            open(private / "isolation.json", "wb") as rep,
        ):
            start = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _BOOT, KILN_ROOT, str(private / "config.json"), str(rep.fileno())],
                cwd=root,
                env=env,
                stdin=inp,
                stdout=out,
                stderr=err,
                pass_fds=(rep.fileno(),),
                start_new_session=True,
            )
            try:
                ended = _watch(proc.pid, root, limits)
            finally:
                # Kill the group while the leader is still a zombie: its pid, which is the group id,
                # cannot have been reused yet, so nothing outside the sandbox is ever signalled.
                _kill_group(proc.pid)
                _, wait_status, usage = os.wait4(proc.pid, 0)
            wall = time.monotonic() - start
            proc.returncode = os.waitstatus_to_exitcode(wait_status)
        result = SandboxResult(
            "ok",
            proc.returncode,
            _tail(private / "stdout", limits.max_output),
            _tail(private / "stderr", limits.max_output),
            wall_s=wall,
            cpu_s=usage.ru_utime + usage.ru_stime,
            pid=proc.pid,
            isolation=_read_json(private / "isolation.json"),
        )
        _classify(result, ended, limits, cpu)
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def run_many(codes: list[str], limits: Limits | None = None, workers: int | None = None) -> list[SandboxResult]:
    """run_python over many programs, `workers` at a time (default: one per CPU), in order."""
    from concurrent.futures import ThreadPoolExecutor

    limits = limits or Limits()
    limits.validate()
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(codes) <= 1:
        return [run_python(c, limits) for c in codes]
    # Threads suffice: each run waits on its own child process.
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda c: run_python(c, limits), codes))


def _unprivileged_ids() -> list[int] | None:
    """[uid, gid] of `nobody` when we are root (the child switches to it), else None."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return None
    return [entry.pw_uid, entry.pw_gid]


def _watch(pid: int, root: Path, limits: Limits) -> str:
    """Wait until the child exits without reaping it: "exited", "timeout", or "disk" (over disk_mb).

    The disk quota is measured here, in the parent, because nothing inside the child can be trusted
    to report it; between two measurements the child can write about DISK_POLL_S times its speed.
    """
    deadline = time.monotonic() + limits.timeout_s
    quota = limits.disk_mb * 1024 * 1024
    # Open files last changed before the child started are not its writing: the dynamic loader
    # holds the interpreter's own shared libraries (libpython is ~23 MB) open for a moment right
    # after exec. The slack covers file timestamps, which lag the clock by a tick.
    since = time.time() - 1.0
    next_measure = 0.0
    delay = 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        now = time.monotonic()
        if now >= next_measure:
            if _disk_bytes(root, pid, since) > quota:
                return "disk"
            next_measure = now + DISK_POLL_S
        left = deadline - now
        if left <= 0:
            return "timeout"
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.02)
    return "exited"


def _disk_bytes(root: Path, pid: int, since: float = 0.0) -> int:
    """Bytes allocated to the folder's files plus the regular files `pid` holds open (deleted ones too)
    that changed at or after `since` (ctime, which no user can set back), each at least ENTRY_BYTES.

    A folder that cannot be listed counts as over any quota: what it holds cannot be measured.
    """
    seen: set[tuple[int, int]] = set()
    total = 0

    def count(st: os.stat_result) -> None:
        nonlocal total
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            # Every entry is charged at least one block, so that millions of empty files (inodes,
            # and the parent's time walking them) count as well.
            total += max(st.st_blocks * 512, st.st_size if stat.S_ISREG(st.st_mode) else 0, ENTRY_BYTES)

    folders = [str(root)]
    while folders:
        try:
            with os.scandir(folders.pop()) as entries:
                for entry in entries:
                    st = entry.stat(follow_symlinks=False)
                    count(st)
                    if stat.S_ISDIR(st.st_mode):
                        folders.append(entry.path)
        except FileNotFoundError:
            continue  # removed while we looked
        except PermissionError:
            return sys.maxsize
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return total
    for fd in descriptors:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_ctime >= since:
            count(st)
    return total


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, chars: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4 * chars))
        return f.read().decode("utf-8", errors="replace")[-chars:]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _classify(result: SandboxResult, ended: str, limits: Limits, cpu: int) -> None:
    code = result.returncode
    marks = [ln[len(MARK) :] for ln in result.stderr.splitlines() if ln.startswith(MARK)]
    if ended == "timeout":
        result.status, result.detail = "timeout", f"wall clock over {limits.timeout_s:g} s"
    elif ended == "disk":
        result.status, result.detail = "forbidden", f"the folder passed disk_mb={limits.disk_mb} (killed)"
    elif code == 0:
        result.status = "ok"
    elif code == FORBIDDEN_EXIT and marks:
        result.status, result.detail = "forbidden", marks[-1]
    elif code == MEMORY_EXIT:
        result.status, result.detail = "memory", f"MemoryError under the {limits.memory_mb} MB address-space limit"
    elif code == FILE_SIZE_EXIT:
        result.status, result.detail = "forbidden", f"a file (or stdout/stderr) passed file_mb={limits.file_mb}"
    elif code == -signal.SIGXCPU or (code == -signal.SIGKILL and result.cpu_s >= cpu):
        result.status, result.detail = "timeout", f"CPU time over {cpu} s"
    elif code is not None and code < 0:
        result.status, result.detail = "killed", f"signal {signal.Signals(-code).name}"
    else:
        last = next((ln for ln in reversed(result.stderr.splitlines()) if ln.strip()), "")
        result.status, result.detail = "error", f"exit code {code}: {last[:300]}"


# ---- the child --------------------------------------------------------------------------------------


def _child_main(config_path: str, report_fd: int) -> None:
    """Confine this process (module docstring, layers 1-5), then run main.py as __main__."""
    import posix
    import runpy
    import traceback

    # Captured before the snippet runs: it may replace os._exit, sys.stdout and anything else.
    exit_now, streams = posix._exit, (sys.stdout, sys.stderr)
    with open(config_path) as f:
        cfg = json.load(f)
    root = cfg["root"]
    report = confine(cfg)
    report["python_guard"] = bool(cfg["python_guard"])
    os.write(report_fd, json.dumps(report).encode())
    os.close(report_fd)
    sys.path.remove(cfg["kiln_root"])
    sys.path.insert(0, root)
    for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]
    if cfg["python_guard"]:
        replace_node_creation()
        sys.addaudithook(make_guard(root, allow_processes=cfg["max_processes"] > 0))
    sys.argv = ["main.py"]
    try:
        runpy.run_path(os.path.join(root, "main.py"), run_name="__main__")
    except MemoryError:
        traceback.print_exc()
        _flush(streams)
        exit_now(MEMORY_EXIT)
    except OSError as err:
        if err.errno != errno.EFBIG:
            raise
        traceback.print_exc()
        _flush(streams)
        exit_now(FILE_SIZE_EXIT)


def _flush(streams) -> None:
    for stream in streams:
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
