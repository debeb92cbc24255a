"""Writing the files Kiln publishes: each under a temporary name in its destination folder, renamed
into place only when complete, and every failure to write it an OSError naming the destination.

`publishing(path)` yields the temporary path a writer fills (torch.save, safetensors, numpy, a
tokenizer's save); on success it is fsynced and renamed to `path`, on failure removed, so `path`
is either its previous version or the complete new one. `reporting(path)` alone turns the
failures of a write that cannot go through a temporary (an append) into that OSError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

# torch.save reports a short write as a RuntimeError from its zip writer ("unexpected pos") and
# safetensors as a SafetensorError quoting the OS error; neither carries an errno or the path.
OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")
# numpy's tofile and save report one as "N requested and M written".
SHORT_WRITE_MARKS = ("unexpected pos", "PytorchStreamWriter failed", "I/O error", "requested and")
# Below this many free bytes a write that stopped short is taken to have filled the disk.
LOW_FREE_BYTES = 64 << 20


def fsync(path: Path) -> None:
    # Data must reach the disk before the rename that publishes it, or a power loss could leave
    # a "complete" file that is empty.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding `path` (its nearest existing folder), None if unknown."""
    for folder in [Path(path), *Path(path).parents]:
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def write_failure(err: BaseException, path, temporary=None) -> OSError | None:
    """The OSError, naming `path`, that `err` raised while writing `path` (through `temporary`)
    stands for; None when `err` is no failure to write."""
    path = str(path)
    if isinstance(err, OSError) and err.errno is not None:
        if err.filename not in (None, str(temporary) if temporary is not None else None):
            return err  # the OS named the file it refused: that is the one to report
        return OSError(err.errno, err.strerror or os.strerror(err.errno), path)
    if not isinstance(err, (OSError, RuntimeError)) and type(err).__name__ != "SafetensorError":
        return None
    text = str(err)
    match = OS_ERROR_CODE.search(text)
    if match:
        code = int(match.group(1) or match.group(2))
        return OSError(code, os.strerror(code), path)
    if not any(mark in text for mark in SHORT_WRITE_MARKS):
        return None
    free = free_bytes(Path(path).parent)
    if free is not None and free < LOW_FREE_BYTES:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return OSError(errno.EIO, f"the write stopped short ({free_text(free)}; a quota may be full)", path)


def free_text(free: int | None) -> str:
    return "free space unknown" if free is None else f"{free / 2**20:.0f} MiB free"


@contextlib.contextmanager
def reporting(path, temporary=None) -> Iterator[None]:
    """Failures to write `path` inside the block leave it as OSErrors naming `path` and the cause."""
    try:
        yield
    except Exception as err:
        failure = write_failure(err, path, temporary)
        if failure is None or failure is err:
            raise
        raise failure from err


@contextlib.contextmanager
def publishing(path) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write; renamed to `path` when the block ends
    and removed if it fails, so no partial file is ever published under `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with reporting(path, tmp):
            yield tmp
            fsync(tmp)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text_atomic(path, text: str) -> None:
    with publishing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def copy_file_atomic(source, path) -> None:
    with publishing(path) as tmp:
        shutil.copyfile(source, tmp)


# The cause a one-line error names for the errors a write or a read of the file system meets.
CAUSES = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOENT: "not found",
    errno.ENOTDIR: "a path component is not a folder",
    errno.EISDIR: "is a folder",
    errno.EEXIST: "already exists",
    errno.EFBIG: "file too large",
    errno.EMFILE: "too many open files",
    errno.ENAMETOOLONG: "name too long",
}


def os_error_line(err: OSError) -> str:
    """`PATH: cause` (`PATH -> PATH2: cause` for a rename or copy) for the one line the CLI prints."""
    cause = CAUSES.get(err.errno) or err.strerror or str(err)
    paths = [str(name) for name in (err.filename, err.filename2) if name is not None]
    if not paths:
        return f"{cause} ({err})" if cause != str(err) else cause
    return f"{' -> '.join(paths)}: {cause}"
