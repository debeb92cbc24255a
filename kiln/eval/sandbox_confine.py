"""What the sandbox's child does to itself before the snippet runs (kiln.eval.sandbox, layers 1-5).

The kernel layers (resource limits, network namespace, `nobody`, Landlock) are set once and cannot
be undone from inside. The audit hook is Python: it is written so that the snippet cannot change
what it does. Everything the hook calls is captured in its closure when it is made (posix functions,
unbound methods of builtin types, the sets of events), it reads no module attribute at call time
(so `os._exit = ...`, `os.sep = ''` or editing this module's globals change nothing), it resolves
paths itself with '/' constants, and it runs no code the snippet could have supplied. The function
itself is referenced only by the interpreter's hook list; the gc and tracing calls that could reach
it or its frame are refused.
"""

from __future__ import annotations

import os
import posix
import resource
import struct
import sys

FORBIDDEN_EXIT = 117
MARK = "kiln-sandbox: "
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
PR_SET_KEEPCAPS, PR_SET_NO_NEW_PRIVS = 8, 38
CAP_DAC_READ_SEARCH = 2
# Landlock (linux/landlock.h): the syscall numbers are the same on every architecture.
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_WRITE_FILE, FS_TRUNCATE = 1 << 1, 1 << 14
# remove_dir, remove_file, make_char/dir/reg/sock/fifo/block/sym: every way to change a directory.
FS_CHANGE_DIRECTORY = sum(1 << bit for bit in range(4, 13))
FS_REFER = 1 << 13  # ABI 2: linking or renaming across directories
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2  # ABI 6


def confine(cfg: dict) -> dict:
    """The kernel layers; returns what was in force (the run's `isolation`)."""
    # ctypes is imported here, not at the top, so that no module global hands it to the snippet.
    import ctypes

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
    # Landlock needs no_new_privs (or CAP_SYS_ADMIN), so it comes after it.
    report["landlock"] = _landlock(libc, cfg["root"], network=cfg["network"])
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


def _landlock(libc, root: str, network: bool) -> str:
    """Let this process change files only beneath `root` (and write /dev/null), kernel-enforced.

    Returns "abi N" when in force, else why not. Reads are not restricted. With ABI 4 TCP bind and
    connect are refused too (unless `network`), with ABI 6 signals to processes outside the sandbox.
    """
    import ctypes

    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    abi = syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 0:
        return f"unavailable ({os.strerror(ctypes.get_errno())})"
    handled = FS_WRITE_FILE | FS_CHANGE_DIRECTORY | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    fields = [handled]
    if abi >= 4:
        fields.append(0 if network else NET_BIND_TCP | NET_CONNECT_TCP)
    if abi >= 6:
        fields.append(SCOPE_SIGNAL | (0 if network else SCOPE_ABSTRACT_UNIX_SOCKET))
    attr = ctypes.create_string_buffer(struct.pack(f"{len(fields)}Q", *fields))
    ruleset = syscall(LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(len(attr.raw)), ctypes.c_uint32(0))
    if ruleset < 0:
        return f"refused ({os.strerror(ctypes.get_errno())})"
    try:
        for path, access in ((root, handled), ("/dev/null", handled & (FS_WRITE_FILE | FS_TRUNCATE))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd))
                if syscall(LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), LANDLOCK_RULE_PATH_BENEATH, rule, 0) != 0:
                    return f"refused a rule for {path} ({os.strerror(ctypes.get_errno())})"
            finally:
                os.close(fd)
        if syscall(LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            return f"refused ({os.strerror(ctypes.get_errno())})"
    finally:
        os.close(ruleset)
    return f"abi {abi}"


# Path arguments (by position) of audit events that change the file system, and where their dir_fd is.
# "kiln.mknod" is raised by the replacements of os.mkfifo and os.mknod, which raise no event of their own.
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
    "kiln.mknod": ((0,), 1),
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
# Limits, and what could reach the hook function, its cells or a frame's locals (gc, tracing).
_ALWAYS_BLOCKED = {
    "resource.setrlimit",
    "resource.prlimit",
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
    "sys.settrace",
    "sys.setprofile",
    "sys._current_frames",
    "sys.monitoring.register_callback",
    # A subinterpreter starts with no audit hooks at all.
    "cpython.PyInterpreterState_New",
}
_BLOCKED_IMPORTS = {"ctypes", "_ctypes", "cffi", "_cffi_backend", "_xxsubinterpreters", "_interpreters"}


def _path_checks(root: str):
    """(as_text, inside, name, is_directory) for the guard, with everything they call captured."""
    lstat, stat, readlink, getcwd = posix.lstat, posix.stat, posix.readlink, posix.getcwd
    is_instance, type_of, text_type, bytes_type, int_type = isinstance, type, str, bytes, int
    split, join, startswith, rfind = str.split, str.join, str.startswith, str.rfind
    decode, show = bytes.decode, str.__repr__
    os_error, value_error, type_error = OSError, ValueError, TypeError

    def as_text(path):
        """An exact str for a str or bytes path (no method of a subclass runs), else None."""
        if is_instance(path, bytes_type):
            return decode(path, "utf-8", "surrogateescape")
        if is_instance(path, text_type):
            return join("", [path])
        return None

    def resolve(path: str) -> str | None:
        """The absolute path with every symlink followed, like os.path.realpath; None on a loop."""
        if not startswith(path, "/"):
            path = getcwd() + "/" + path
        resolved, todo, hops = "", split(path, "/")[::-1], 0
        while todo:
            name = todo.pop()
            if name == "" or name == ".":
                continue
            if name == "..":
                resolved = resolved[: rfind(resolved, "/")] if resolved else ""
                continue
            candidate = resolved + "/" + name
            try:
                mode = lstat(candidate).st_mode
            except (os_error, value_error):
                resolved = candidate
                continue
            if mode & 0o170000 != 0o120000:
                resolved = candidate
                continue
            hops += 1
            if hops > 40:
                return None
            target = readlink(candidate)
            if startswith(target, "/"):
                resolved = ""
            todo.extend(split(target, "/")[::-1])
        return resolved or "/"

    base = resolve(root)

    def inside(path, dir_fd=None) -> bool:
        if is_instance(path, int_type):
            # A descriptor (fchmod, fchown, ...): what it was opened on.
            path = readlink(f"/proc/self/fd/{int_type(path)}")
            if not startswith(path, "/"):
                return True  # a pipe or socket: not a file of the file system
        path = as_text(path)
        if path is None:
            return False
        if dir_fd is not None and dir_fd != -1 and not startswith(path, "/"):
            path = readlink(f"/proc/self/fd/{int_type(dir_fd)}") + "/" + path
        resolved = resolve(path)
        return resolved is not None and (
            resolved == base or startswith(resolved, base + "/") or resolved == "/dev/null"
        )

    def name(path) -> str:
        if is_instance(path, int_type):
            return f"descriptor {int_type(path)} ({show(readlink(f'/proc/self/fd/{int_type(path)}'))})"
        text = as_text(path)
        return show(text) if text is not None else f"a {type_of(path).__name__} path"

    def is_directory(path) -> bool:
        try:
            return stat(path).st_mode & 0o170000 == 0o040000
        except (os_error, value_error, type_error):
            return False

    return as_text, inside, name, is_directory


def make_guard(root: str, allow_processes: bool):
    """The audit hook: ends the run with FORBIDDEN_EXIT on anything the sandbox module lists."""
    _exit, write = posix._exit, posix.write
    is_instance, length, any_of, type_of = isinstance, len, any, type
    text_type, int_type = str, int
    split, startswith, contains, encode = str.split, str.startswith, str.__contains__, str.encode
    base_error = BaseException
    stdout, flush = sys.stdout, type(sys.stdout).flush
    path_events, process_events = dict(_PATH_EVENTS), frozenset(_PROCESS_EVENTS)
    always_blocked = frozenset(_ALWAYS_BLOCKED)
    blocked_imports = frozenset(_BLOCKED_IMPORTS | (set() if allow_processes else {"_posixsubprocess"}))
    own_pid, own_group = posix.getpid(), posix.getpgid(0)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    mark, forbidden_exit = MARK, FORBIDDEN_EXIT
    as_text, inside, name, is_directory = _path_checks(root)

    def deny(what: str) -> None:
        try:
            flush(stdout)
        except base_error:
            pass
        write(2, encode(f"\n{mark}forbidden: {what}\n", "utf-8", "replace"))
        _exit(forbidden_exit)

    def check(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (is_instance(mode, text_type) and any_of(contains(mode, c) for c in "wax+")) or (
                (flags or 0) & write_flags
            ) != 0
            if is_instance(path, int_type):
                return  # wrapping a descriptor grants nothing its opening did not
            if writes and not inside(path):
                deny(f"writing {name(path)} outside the sandbox folder")
            if not writes and as_text(path) is not None and is_directory(path) and not inside(path):
                deny(f"opening directory {name(path)} outside the sandbox folder")
        elif event in path_events:
            positions, fd_at = path_events[event]
            dir_fd = args[fd_at] if fd_at is not None and length(args) > fd_at else None
            for i in positions:
                if not inside(args[i], dir_fd):
                    deny(f"{event} on {name(args[i])} outside the sandbox folder")
        elif startswith(event, "socket."):
            deny(f"network access ({event})")
        elif event in process_events and not allow_processes:
            deny(f"starting a process ({event})")
        elif (event == "os.kill" or event == "os.killpg") and args[0] not in (0, own_pid, own_group):
            deny(f"{event} of another process ({args[0]})")
        elif event == "import" and split(as_text(args[0]) or "", ".")[0] in blocked_imports:
            deny(f"importing {name(args[0])}")
        elif event in always_blocked or startswith(event, "ctypes."):
            deny(event)

    def hook(event: str, args: tuple) -> None:
        try:
            check(event, args)
        except base_error as err:
            # Fail closed: an error inside the guard must not let the operation through.
            deny(f"{event} could not be checked ({type_of(err).__name__})")

    return hook


def replace_node_creation() -> None:
    """os.mkfifo and os.mknod raise no audit event: replace them with versions that raise one.

    The snippet can get the originals back (a fresh `posix` module, the replacement's closure), so
    this only covers honest code; Landlock is what stops the rest.
    """
    audit = sys.audit

    def checked(original):
        def create(path, *args, dir_fd=None, **kwargs):
            audit("kiln.mknod", path, -1 if dir_fd is None else dir_fd)
            return original(path, *args, dir_fd=dir_fd, **kwargs)

        create.__name__ = original.__name__
        return create

    for attr in ("mkfifo", "mknod"):
        replacement = checked(getattr(posix, attr))
        setattr(posix, attr, replacement)
        setattr(os, attr, replacement)
