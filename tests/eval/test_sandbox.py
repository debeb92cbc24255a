"""Hostile snippets in the sandbox: each ends with a clear status and the parent stays healthy."""

import dis
import os
import re
import socket
import types
from importlib.util import find_spec
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.eval.sandbox import Limits, run_many, run_python
from kiln.eval.sandbox_confine import make_guard

FAST = Limits(timeout_s=3.0)


def assert_group_gone(result):
    """Nothing of the child's process group survives the run."""
    with pytest.raises(ProcessLookupError):
        os.killpg(result.pid, 0)


def landlock_abi(result) -> int:
    state = result.isolation.get("landlock", "")
    return int(state.split()[1]) if state.startswith("abi ") else 0


def test_a_normal_program_runs_in_its_own_folder():
    code = (
        "import os, sys, tempfile\n"
        "open('out.txt', 'w').write('data')\n"
        "os.mkdir('sub'); os.rename('out.txt', 'sub/out.txt')\n"
        "fd, name = tempfile.mkstemp(); os.close(fd); os.remove(name)\n"
        "import helper, pathlib\n"
        "pathlib.Path('p.txt').write_text('via pathlib'); os.mkfifo('fifo'); os.remove('fifo')\n"
        "print(open('sub/out.txt').read(), helper.VALUE, sys.stdin.read(), os.getcwd() == os.environ['HOME'])\n"
    )
    result = run_python(code, FAST, files={"helper.py": "VALUE = 41 + 1\n"}, stdin="from stdin")
    assert result.status == "ok" and result.returncode == 0, result.stderr
    assert result.stdout == "data 42 from stdin True\n"
    assert result.isolation["python_guard"] is True and result.isolation["nproc"] == 0
    assert "landlock" in result.isolation
    assert_group_gone(result)


def test_failures_are_errors_with_the_last_line():
    result = run_python("assert 1 + 1 == 3, 'arithmetic is broken'", FAST)
    assert result.status == "error" and result.returncode == 1
    assert "AssertionError: arithmetic is broken" in result.detail


def test_infinite_loop_and_sleep_time_out():
    for code in ("while True:\n    pass", "import time\ntime.sleep(60)"):
        result = run_python(code, Limits(timeout_s=0.5))
        assert result.status == "timeout" and "wall clock" in result.detail
        assert result.wall_s < 30
        assert_group_gone(result)


def test_cpu_limit_ends_a_busy_loop_before_the_wall_clock():
    result = run_python("while True:\n    pass", Limits(timeout_s=60.0, cpu_s=1))
    assert result.status == "timeout" and "CPU time" in result.detail, (result.returncode, result.detail)


def test_fork_bomb_is_forbidden():
    result = run_python("import os\nwhile True:\n    os.fork()", FAST)
    assert result.status == "forbidden" and "os.fork" in result.detail
    assert_group_gone(result)
    for code in ("import subprocess", "import os; os.system('echo hi')", "import pty; pty.fork()"):
        result = run_python(code, FAST)
        assert result.status == "forbidden", (code, result.status, result.detail)


def test_huge_allocation_is_a_memory_error():
    result = run_python("x = bytearray(64 * 1024 ** 3)\nprint('allocated')", Limits(timeout_s=5.0, memory_mb=256))
    assert result.status == "memory" and result.stdout == ""
    result = run_python("x = []\nwhile True:\n    x.append(bytearray(10 ** 7))", Limits(timeout_s=20.0, memory_mb=256))
    assert result.status == "memory"
    # The child's own exit path does not go through the os._exit the snippet can replace.
    result = run_python("import os; os._exit = lambda *a: None\nraise MemoryError", FAST)
    assert result.status == "memory" and not result.passed, (result.status, result.detail)


def test_writing_outside_the_folder_is_forbidden(tmp_path):
    outside = tmp_path / "escape.txt"
    attempts = [
        f"open({str(outside)!r}, 'w').write('x')",
        "open('../escape.txt', 'w').write('x')",
        f"import os; os.symlink({str(tmp_path)!r}, 'link'); open('link/escape.txt', 'w').write('x')",
        f"import os; fd = os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT); os.write(fd, b'x')",
        f"import os; os.remove({str(tmp_path / 'keep.txt')!r})",
        f"import os; os.rename({str(tmp_path / 'keep.txt')!r}, 'stolen.txt')",
        f"import os; d = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
        "os.open('escape.txt', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
        "import shutil; shutil.rmtree('/usr/share/doc')",
    ]
    (tmp_path / "keep.txt").write_text("precious")
    for code in attempts:
        result = run_python(code, FAST)
        assert result.status == "forbidden", (code, result.status, result.detail)
        assert "outside the sandbox folder" in result.detail
    assert not outside.exists() and not (tmp_path.parent / "escape.txt").exists()
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_file_size_limit():
    result = run_python("open('big.bin', 'wb').write(b'x' * (3 * 1024 * 1024))", Limits(timeout_s=5.0, file_mb=1))
    assert result.status == "forbidden" and "file_mb=1" in result.detail
    result = run_python("print('y' * (3 * 1024 * 1024))", Limits(timeout_s=5.0, file_mb=1, max_output=100))
    assert result.status == "forbidden" and len(result.stdout) <= 100


def test_opening_a_socket_is_forbidden():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        for code in (
            "import socket; socket.socket()",
            f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)",
            "import urllib.request; urllib.request.urlopen('http://example.com', timeout=1)",
        ):
            result = run_python(code, FAST)
            assert result.status == "forbidden" and "network" in result.detail, (code, result.detail)
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()


def test_other_processes_cannot_be_signalled_and_limits_cannot_be_raised():
    result = run_python(f"import os, signal; os.kill({os.getppid()}, signal.SIGTERM)", FAST)
    assert result.status == "forbidden" and "os.kill" in result.detail
    result = run_python("import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))", FAST)
    assert result.status == "forbidden"
    result = run_python("import ctypes", FAST)
    assert result.status == "forbidden" and "ctypes" in result.detail


def test_kernel_layers_hold_without_the_audit_hook(tmp_path):
    """With the Python guard off, what the kernel still enforces (where this machine allows it)."""
    probe = run_python("pass", FAST)
    off = Limits(timeout_s=3.0, python_guard=False)
    if probe.isolation.get("nproc_enforced"):
        result = run_python("import os\nwhile True:\n    os.fork()", off)
        assert result.status == "error" and "Resource temporarily unavailable" in result.detail
        assert_group_gone(result)
    if probe.isolation.get("network") in ("namespace", "user namespace"):
        result = run_python("import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)", off)
        # Landlock (ABI 4 on) refuses the connect before the empty namespace can answer.
        refusal = "Permission denied" if landlock_abi(probe) >= 4 else "unreachable"
        assert result.status == "error" and refusal in result.detail
    if probe.isolation.get("user") == "nobody":
        tmp_path.chmod(0o755)
        result = run_python(f"open({str(tmp_path / 'escape.txt')!r}, 'w')", off)
        assert result.status == "error" and "Permission denied" in result.detail
        assert not (tmp_path / "escape.txt").exists()
    if not (probe.isolation.get("nproc_enforced") or probe.isolation.get("network") != "none"):
        pytest.skip(f"no kernel layer available here: {probe.isolation}")


def test_run_many_keeps_order_and_the_parent_stays_healthy():
    codes = [f"print({i} * {i})" for i in range(6)] + ["import os; os.fork()", "x = bytearray(2 ** 40)"]
    results = run_many(codes, FAST, workers=3)
    assert [r.stdout for r in results[:6]] == [f"{i * i}\n" for i in range(6)]
    assert [r.status for r in results[6:]] == ["forbidden", "memory"]
    # After every hostile run, the parent still starts and reads a child normally.
    assert run_python("print('still fine')", FAST).stdout == "still fine\n"


def test_limits_are_validated():
    with pytest.raises(ConfigError, match="timeout_s"):
        run_python("pass", Limits(timeout_s=0))
    with pytest.raises(ConfigError, match="memory_mb"):
        run_python("pass", Limits(memory_mb=8))
    with pytest.raises(ConfigError, match="files"):
        run_python("pass", FAST, files={"../x.py": ""})


def world_writable(tmp_path):
    """A folder `nobody` may write to, like /tmp: only the guard and Landlock keep the snippet out."""
    tmp_path.chmod(0o777)
    (tmp_path / "keep.txt").write_text("precious")
    (tmp_path / "keep.txt").chmod(0o666)
    return tmp_path


# Each attacks the audit hook itself, then tries to write or delete `{out}` (a world-writable folder).
GUARD_ATTACKS = {
    "os._exit replaced": "import os; os._exit = lambda *a: None\nopen({out!r} + '/escape.txt', 'w').write('x')",
    "os._exit replaced, then delete": "import os; os._exit = lambda *a: None\nos.remove({out!r} + '/keep.txt')",
    "os._exit replaced, then ctypes": "import os; os._exit = lambda *a: None\nimport ctypes\n"
    "ctypes.CDLL(None).unlink(({out!r} + '/keep.txt').encode())",
    "os.sep emptied": "import os; os.sep = ''\nopen(os.getcwd() + '-escape.txt', 'w').write('x')",
    "os.path tampered": "import os, stat; os.symlink({out!r}, 'link')\n"
    "stat.S_ISLNK = lambda mode: False; os.path.realpath = os.path.abspath = lambda p, **k: os.getcwd()\n"
    "open('link/escape.txt', 'w').write('x')",
    "guard tables emptied": "import sys\nfor m in list(sys.modules.values()):\n"
    "    for table in ('_PATH_EVENTS', '_guard_tables'):\n"
    "        getattr(m, table, {{}}).clear()\n"
    "import os; os.remove({out!r} + '/keep.txt')",
    "builtins replaced": "import builtins; builtins.isinstance = lambda *a: True; builtins.len = lambda x: 0\n"
    "open({out!r} + '/escape.txt', 'w').write('x')",
    "builtins.bool replaced": "import builtins, os; builtins.bool = lambda x=0: False\n"
    "os.open({out!r} + '/escape.txt', os.O_WRONLY | os.O_CREAT)",
    "descriptor chmod": "import os; fd = os.open({out!r} + '/keep.txt', os.O_RDONLY); os.chmod(fd, 0o600)",
    "mkfifo outside": "import os; os.mkfifo({out!r} + '/escape.txt')",
    "mknod outside via dir_fd": "import os, stat; d = os.open({out!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
    "os.mknod('escape.txt', 0o600 | stat.S_IFREG, dir_fd=d)",
    "gc reaches the hook": "import gc; gc.get_objects()",
    # A subinterpreter has no audit hooks: loaded from its file, so that no import statement names it.
    "subinterpreter": "import glob, sys, importlib.machinery as m, importlib.util as u\n"
    "path = [p for d in sys.path for p in glob.glob(d + '/_xxsubinterpreters*.so')][0]\n"
    "si = u.module_from_spec(m.ModuleSpec('_xxsubinterpreters', m.ExtensionFileLoader('_xxsubinterpreters', path), origin=path))\n"
    "si.run_string(si.create(), 'open(' + repr({out!r} + '/escape.txt') + ', \"w\").write(\"x\")')",
}


@pytest.mark.parametrize("attack", list(GUARD_ATTACKS))
def test_attacks_on_the_guard_are_forbidden_and_change_nothing(tmp_path, attack):
    if attack == "subinterpreter" and not str(getattr(find_spec("_xxsubinterpreters"), "origin", "")).endswith(".so"):
        pytest.skip("this Python has no _xxsubinterpreters extension file")
    out = world_writable(tmp_path)
    code = GUARD_ATTACKS[attack].format(out=str(out)) + "\nprint('escaped')"
    result = run_python(code, FAST)
    assert result.status == "forbidden" and not result.passed, (attack, result.status, result.detail, result.stderr)
    assert "escaped" not in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"], attack
    assert (out / "keep.txt").read_text() == "precious" and (out / "keep.txt").stat().st_mode & 0o777 == 0o666
    assert not list(tmp_path.parent.glob("kiln-sandbox-*-escape.txt"))
    assert not list(__import__("pathlib").Path("/tmp").glob("kiln-sandbox-*-escape.txt"))


def test_the_guard_reads_no_global_or_builtin_name_when_called():
    """Every function the hook can reach uses only its closure: nothing the snippet could rebind."""
    hook = make_guard("/tmp", allow_processes=False)
    functions, seen, loaded = [hook], set(), {}
    while functions:
        function = functions.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        codes = [function.__code__]
        while codes:
            code = codes.pop()
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
            names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
            if names:
                loaded[code.co_name] = names
        functions += [
            c.cell_contents for c in function.__closure__ or () if isinstance(c.cell_contents, types.FunctionType)
        ]
    assert len(seen) >= 5 and loaded == {}


def test_named_violations():
    result = run_python("import os; os._exit = None\nopen('/tmp/kiln-sandbox-named.txt', 'w')", FAST)
    assert "writing '/tmp/kiln-sandbox-named.txt' outside the sandbox folder" in result.detail
    result = run_python("import os; os.mkfifo('/tmp/kiln-sandbox-named.fifo')", FAST)
    assert "kiln.mknod on '/tmp/kiln-sandbox-named.fifo' outside the sandbox folder" in result.detail
    here = os.path.realpath(__file__)
    result = run_python(f"import os; os.chmod(os.open({here!r}, os.O_RDONLY), 0o777)", FAST)
    assert re.search(rf"os.chmod on descriptor \d+ \({re.escape(repr(here))}\) outside the sandbox", result.detail)
    assert not os.path.exists("/tmp/kiln-sandbox-named.txt") and not os.path.exists("/tmp/kiln-sandbox-named.fifo")


def test_landlock_holds_when_the_guard_is_bypassed(tmp_path):
    """A fresh posix module has the original mkfifo; with the guard off entirely, only the kernel is left."""
    probe = run_python("pass", FAST)
    if not landlock_abi(probe):
        pytest.skip(f"Landlock is not available here: {probe.isolation.get('landlock')}")
    out = world_writable(tmp_path)
    fresh_posix = (
        "import importlib.machinery, importlib.util\n"
        "posix = importlib.util.module_from_spec(importlib.machinery.BuiltinImporter.find_spec('posix'))\n"
        f"posix.mkfifo({str(out / 'escape.txt')!r})"
    )
    result = run_python(fresh_posix, FAST)
    assert result.status == "error" and "Permission denied" in result.detail, result.detail
    off = Limits(timeout_s=3.0, python_guard=False)
    for code in (
        fresh_posix,
        f"open({str(out / 'escape.txt')!r}, 'w')",
        f"import os; os.remove({str(out / 'keep.txt')!r})",
        f"import os; os.rename({str(out / 'keep.txt')!r}, 'stolen.txt')",
        f"import ctypes; assert ctypes.CDLL(None).unlink({str(out / 'keep.txt').encode()!r}) == 0, 'refused'",
    ):
        result = run_python(code, off)
        assert result.status == "error", (code, result.status)
        assert "Permission denied" in result.detail or "refused" in result.detail, (code, result.detail)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    # Inside the folder the kernel allows everything the guard does.
    result = run_python("import os; os.mkfifo('f'); os.mkdir('d'); os.rename('f', 'd/f'); os.remove('d/f')", off)
    assert result.status == "ok", result.detail


def write_megabytes(count: int, delete: bool = False) -> str:
    """A program writing `count` 1 MB files, one every 50 ms, printing each index; with `delete`,
    each file is removed at once but kept open (it still takes disk space until closed)."""
    remove = "os.remove(f'part{i}'); " if delete else ""
    return (
        f"import os, time\nkeep = []\nfor i in range({count}):\n"
        f"    f = open(f'part{{i}}', 'wb'); {remove}f.write(b'x' * 1024 * 1024); f.flush(); keep.append(f)\n"
        "    print(i, flush=True); time.sleep(0.05)\n"
    )


def test_the_folder_quota_is_enforced_from_outside():
    quota = Limits(timeout_s=60.0, file_mb=2, disk_mb=8)
    for delete in (False, True):
        result = run_python(write_megabytes(200, delete), quota)
        assert result.status == "forbidden" and "disk_mb=8" in result.detail, (delete, result.status, result.detail)
        # Over 8 MB takes 8 files (main.py adds a block); the 8th may be killed before it prints.
        assert 7 <= len(result.stdout.split()) < 200, (delete, result.stdout)
    assert run_python(write_megabytes(4), quota).passed
    # Empty files cost inodes: each is charged a block (4096 bytes), so 1 MB allows about 256.
    empty = "import time\nfor i in range(100000):\n    open(f'e{i}', 'w').close()\n    print(i, flush=True)\n"
    result = run_python(empty + "time.sleep(30)\n", Limits(timeout_s=60.0, disk_mb=1))
    assert result.status == "forbidden" and "disk_mb=1" in result.detail, (result.status, result.detail)
    assert 250 <= len(result.stdout.split()) < 100000


def test_large_files_the_child_only_reads_are_not_charged_to_its_quota():
    # Right after exec the loader holds libpython (~23 MB) open; reading any old large file is the
    # same case. Only what changed since the child started is its writing.
    lib = Path(find_spec("torch").origin).parent / "lib"
    big = max(lib.iterdir(), key=lambda p: p.stat().st_size)
    assert big.stat().st_size > 8 * 1024 * 1024, big
    reader = f"import time\nf = open({str(big)!r}, 'rb')\nf.read(16)\ntime.sleep(0.5)\nprint('read', flush=True)\n"
    result = run_python(reader, Limits(timeout_s=60.0, disk_mb=8))
    assert result.passed and result.stdout.strip() == "read", (result.status, result.detail)
