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
4. a Python audit hook (PEP 578) that ends the run as "forbidden" on: a write, create, rename,
   delete, chmod, link or truncate outside the folder (symlinks resolved), opening a directory
   outside it, any socket call, starting a process (fork, exec, spawn, system, subprocess, and
   importing _posixsubprocess, whose fork_exec has no audit event), signalling other processes,
   raising resource limits, and ctypes/cffi.

What is not prevented, exactly: reading files (the snippet can read whatever the child's user can;
as `nobody` with CAP_DAC_READ_SEARCH that is every file); writes to world-writable places such as
/tmp when the audit hook is bypassed (audit hooks are not a security boundary: code that reaches
native memory could disable it, and only layers 1-3, which the kernel enforces, remain then);
without root, the child runs as the caller's own user, so writes outside the folder are stopped by
the audit hook alone, and RLIMIT_NPROC counts all of that user's processes; with max_processes > 0
a grandchild that calls setsid() leaves the process group and survives the final kill. `isolation`
in each result says which layers were actually in force.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import ConfigError

STATUSES = ("ok", "error", "timeout", "memory", "forbidden", "killed")
FORBIDDEN_EXIT, MEMORY_EXIT, FILE_SIZE_EXIT = 117, 118, 119
MARK = "kiln-sandbox: "
KILN_ROOT = str(Path(__file__).resolve().parents[2])
# The child imports this module by path (-I ignores PYTHONPATH and the user's site folder).
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); from kiln.eval.sandbox import _child_main; "
    "_child_main(sys.argv[2], int(sys.argv[3]))"
)
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 8, 38
CAP_DAC_READ_SEARCH = 2


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock
    cpu_s: int | None = None  # CPU seconds; None: ceil(timeout_s) + 1, so the wall clock usually fires first
    memory_mb: int = 1024  # address space, which counts more than resident memory
    file_mb: int = 16  # largest file written, stdout and stderr included
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
        for key in ("file_mb", "max_open_files", "max_output"):
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
                timed_out = _wait_exited(proc.pid, limits.timeout_s)
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
        _classify(result, timed_out, limits, cpu)
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


def _wait_exited(pid: int, timeout: float) -> bool:
    """Wait until the child exits without reaping it; True if the timeout came first."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.02)
    return False


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


def _classify(result: SandboxResult, timed_out: bool, limits: Limits, cpu: int) -> None:
    code = result.returncode
    marks = [ln[len(MARK) :] for ln in result.stderr.splitlines() if ln.startswith(MARK)]
    if timed_out:
        result.status, result.detail = "timeout", f"wall clock over {limits.timeout_s:g} s"
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
    """Confine this process (module docstring, layers 1-4), then run main.py as __main__."""
    import runpy
    import traceback

    with open(config_path) as f:
        cfg = json.load(f)
    root = cfg["root"]
    report = _confine(cfg)
    report["python_guard"] = bool(cfg["python_guard"])
    os.write(report_fd, json.dumps(report).encode())
    os.close(report_fd)
    sys.path.remove(cfg["kiln_root"])
    sys.path.insert(0, root)
    for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]
    if cfg["python_guard"]:
        sys.addaudithook(_guard(root, allow_processes=cfg["max_processes"] > 0))
    sys.argv = ["main.py"]
    try:
        runpy.run_path(os.path.join(root, "main.py"), run_name="__main__")
    except MemoryError:
        traceback.print_exc()
        _flush_and_exit(MEMORY_EXIT)
    except OSError as err:
        if err.errno != errno.EFBIG:
            raise
        traceback.print_exc()
        _flush_and_exit(FILE_SIZE_EXIT)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _confine(cfg: dict) -> dict:
    import ctypes
    import resource

    report: dict = {}
    mb = 1024 * 1024

    def limit(which, value: int) -> None:
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))

    _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
    cpu = cfg["cpu_s"]
    # Soft limit: SIGXCPU; one second later the hard limit sends SIGKILL.
    resource.setrlimit(
        resource.RLIMIT_CPU, (cpu, cpu + 1 if cpu_hard == resource.RLIM_INFINITY else min(cpu + 1, cpu_hard))
    )
    limit(resource.RLIMIT_AS, cfg["memory_mb"] * mb)
    limit(resource.RLIMIT_FSIZE, cfg["file_mb"] * mb)
    limit(resource.RLIMIT_NOFILE, cfg["max_open_files"])
    limit(resource.RLIMIT_CORE, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    report["network"] = "allowed" if cfg["network"] else _unshare_network(libc, root=os.geteuid() == 0)
    if cfg["drop"] is not None:
        uid, gid = cfg["drop"]
        libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        report["user"] = "nobody"
        report["read_everything"] = _capset(libc, 1 << CAP_DAC_READ_SEARCH)
    else:
        report["user"] = "caller"
        if report["network"] == "user namespace":
            _capset(libc, 0)  # the new namespace granted every capability inside it
    report["no_new_privs"] = libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    extra = cfg["max_processes"]
    nproc = 0 if extra == 0 else _count_tasks(os.getuid()) + extra
    limit(resource.RLIMIT_NPROC, nproc)
    report["nproc"] = nproc
    report["nproc_enforced"] = os.getuid() != 0  # the kernel never applies RLIMIT_NPROC to root
    return report


def _unshare_network(libc, root: bool) -> str:
    if libc.unshare(CLONE_NEWNET) == 0:
        return "namespace"
    if root:
        return "none"  # a user namespace would leave no way to become nobody afterwards
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return "none"
    try:
        # Map our own ids, so files we create still belong to us (unmapped ids cannot create files).
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError:
        return "user namespace (ids unmapped)"
    return "user namespace"


def _capset(libc, caps: int) -> bool:
    """Set the permitted and effective capability sets to `caps` (bits below 32)."""
    import ctypes
    import struct

    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0))  # _LINUX_CAPABILITY_VERSION_3
    data = ctypes.create_string_buffer(struct.pack("6I", caps, caps, 0, 0, 0, 0))
    return libc.capset(header, data) == 0


def _count_tasks(uid: int) -> int:
    """Threads of every process of `uid` (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


# Path arguments (by position) of audit events that change the file system, and where their dir_fd is.
_PATH_EVENTS = {
    "os.remove": ((0,), 1),
    "os.rmdir": ((0,), 1),
    "os.mkdir": ((0,), 2),
    "os.rename": ((0, 1), 2),
    "os.link": ((0, 1), 2),
    "os.symlink": ((1,), 2),
    "os.truncate": ((0,), None),
    "os.chmod": ((0,), 2),
    "os.chown": ((0,), 3),
    "os.utime": ((0,), 3),
    "os.chflags": ((0,), None),
    "os.lchflags": ((0,), None),
    "os.setxattr": ((0,), None),
    "os.removexattr": ((0,), None),
}
_PROCESS_EVENTS = {
    "os.fork",
    "os.forkpty",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "subprocess.Popen",
    "pty.spawn",
    "os.startfile",
}
_ALWAYS_BLOCKED = {"resource.setrlimit", "resource.prlimit"}
_BLOCKED_IMPORTS = {"ctypes", "_ctypes", "cffi", "_cffi_backend"}


def _guard(root: str, allow_processes: bool):
    """The audit hook: ends the run with FORBIDDEN_EXIT on anything the module docstring lists."""
    realpath, isdir, fsdecode, getpid = os.path.realpath, os.path.isdir, os.fsdecode, os.getpid
    base = realpath(root)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked_imports = _BLOCKED_IMPORTS | (set() if allow_processes else {"_posixsubprocess"})

    def inside(path, dir_fd=None) -> bool:
        if isinstance(path, int):
            return True  # an already open descriptor: opening it was checked
        path = fsdecode(path)
        if dir_fd not in (None, -1) and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        resolved = realpath(path)
        return resolved == base or resolved.startswith(base + os.sep) or resolved == "/dev/null"

    def deny(what: str) -> None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.write(2, f"\n{MARK}forbidden: {what}\n".encode("utf-8", errors="replace"))
        os._exit(FORBIDDEN_EXIT)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & write_flags)
            if writes and not inside(path):
                deny(f"writing {fsdecode(path)!r} outside the sandbox folder")
            if not writes and not isinstance(path, int) and isdir(path) and not inside(path):
                deny(f"opening directory {fsdecode(path)!r} outside the sandbox folder")
        elif event in _PATH_EVENTS:
            positions, fd_at = _PATH_EVENTS[event]
            dir_fd = args[fd_at] if fd_at is not None and len(args) > fd_at else None
            for i in positions:
                if not inside(args[i], dir_fd):
                    deny(f"{event} on {fsdecode(args[i])!r} outside the sandbox folder")
        elif event.startswith("socket."):
            deny(f"network access ({event})")
        elif event in _PROCESS_EVENTS and not allow_processes:
            deny(f"starting a process ({event})")
        elif event in ("os.kill", "os.killpg") and args[0] not in (0, getpid(), os.getpgid(0)):
            deny(f"{event} of another process ({args[0]})")
        elif event == "import" and args[0].split(".")[0] in blocked_imports:
            deny(f"importing {args[0]}")
        elif event in _ALWAYS_BLOCKED or event.startswith("ctypes."):
            deny(event)

    return hook
