"""Paths on any file system fsspec knows (`s3://bucket/key`, `gs://`, `memory://`), beside local ones.

A local path (no `PROTOCOL://`, or `file://`) keeps Kiln's local behaviour exactly: callers take the
local branch (kiln.files: temporary name, fsync, rename). A remote path goes through fsspec. Object
stores have no rename, so a folder is published by uploading every file and the folder's marker
(a checkpoint's manifest, a stage's DONE) last: each object appears whole or not at all, and
readers take a folder without its marker as absent. See docs/storage.md.

Options for a protocol (credentials, `endpoint_url` of an S3-compatible server) come from
`configure` (the recipe's `[storage]` table) and otherwise from the protocol's own environment
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for s3).
"""

from __future__ import annotations

import contextlib
import glob as local_glob
import hashlib
import os
import posixpath
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator

import fsspec
from fsspec.core import split_protocol

from kiln.errors import ConfigError

LOCAL_PROTOCOLS = (None, "file", "local")
# Listings are read right after uploads (is the manifest there yet?): a cached listing would answer
# from before the upload.
DEFAULTS = {"s3": {"use_listings_cache": False}}
_options: dict[str, dict] = {}


# Credentials stay out of recipes: a recipe is copied into every run folder and checkpoint manifest.
SECRET_OPTIONS = ("key", "secret", "token", "access_key", "secret_key", "session_token", "password")


@dataclass
class StorageConfig:
    """[storage]: options of the file systems behind fsspec URLs."""

    # [storage.s3]: s3fs options (endpoint_url for an S3-compatible server, client_kwargs, anon, ...)
    s3: dict = field(default_factory=dict)

    def validate(self) -> None:
        for name in self.s3:
            if name in SECRET_OPTIONS:
                raise ConfigError(
                    f"s3.{name}",
                    "credentials do not belong in a recipe (it is copied into run folders and checkpoints); "
                    "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or an AWS profile",
                )

    def options(self) -> dict[str, dict]:
        return {"s3": self.s3} if self.s3 else {}


def configure(options: dict[str, dict]) -> None:
    """Storage options per protocol (`{"s3": {"endpoint_url": ..., "key": ...}}`), for every later call."""
    for protocol, table in options.items():
        if not isinstance(table, dict):
            raise ConfigError(f"storage.{protocol}", "must be a table of fsspec storage options")
    _options.clear()
    _options.update({protocol: dict(table) for protocol, table in options.items()})


def protocol_of(path) -> str | None:
    return split_protocol(str(path))[0]


def is_remote(path) -> bool:
    return isinstance(path, str) and protocol_of(path) not in LOCAL_PROTOCOLS


def filesystem(path) -> fsspec.AbstractFileSystem:
    protocol = protocol_of(path)
    try:
        return fsspec.filesystem(protocol, **{**DEFAULTS.get(protocol, {}), **_options.get(protocol, {})})
    except (ImportError, ValueError) as err:
        raise ConfigError("storage", f"{path}: no file system for {protocol}:// ({err})") from None


def join(base, *parts: str):
    """`base/part/...`: a Path for a local base, a URL string for a remote one."""
    if is_remote(base):
        return posixpath.join(str(base).rstrip("/"), *parts)
    return Path(base).joinpath(*parts)


def name_of(path) -> str:
    return posixpath.basename(str(path).rstrip("/"))


def parent_of(path):
    return str(path).rstrip("/").rsplit("/", 1)[0] if is_remote(path) else Path(path).parent


def _qualify(path: str, like) -> str:
    """fsspec lists remote paths without their protocol; Kiln passes them around as full URLs."""
    protocol = protocol_of(like)
    return path if protocol_of(path) else f"{protocol}://{path}"


def exists(path) -> bool:
    return filesystem(path).exists(str(path)) if is_remote(path) else Path(path).exists()


def isfile(path) -> bool:
    return filesystem(path).isfile(str(path)) if is_remote(path) else Path(path).is_file()


def isdir(path) -> bool:
    return filesystem(path).isdir(str(path)) if is_remote(path) else Path(path).is_dir()


def glob(pattern: str) -> list[str]:
    """Sorted matches of a glob pattern (`**` recursive), as full URLs for a remote pattern."""
    if not is_remote(pattern):
        return sorted(local_glob.glob(pattern, recursive=True))
    return sorted(_qualify(p, pattern) for p in filesystem(pattern).glob(pattern))


def walk_files(folder) -> list[str]:
    """Every file under a remote folder, recursively, as full URLs, sorted."""
    return sorted(_qualify(p, folder) for p in filesystem(folder).find(str(folder)))


def open_file(path, mode: str = "rb") -> IO:
    if is_remote(path):
        return filesystem(path).open(str(path), mode)
    return open(path, mode)


def read_bytes(path) -> bytes:
    with open_file(path, "rb") as fh:
        return fh.read()


def read_text(path) -> str:
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
    """One object, written whole: an object store shows it complete or not at all."""
    filesystem(path).pipe_file(str(path), data)


def upload(local: Path, remote: str) -> None:
    filesystem(remote).put_file(str(local), remote)


def download(remote: str, local: Path) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    filesystem(remote).get_file(remote, str(local))


def remove(path: str, recursive: bool = False) -> None:
    fs = filesystem(path)
    if fs.exists(path):
        fs.rm(path, recursive=recursive)


def publish_folder(local: Path, remote: str, marker: str, names: Iterable[str] | None = None) -> None:
    """Upload the files of `local` (or the relative `names`) under `remote`, `marker` last.

    A folder already published there is unpublished first (its marker removed), so readers never
    see an old marker over a mix of old and new files. A failure part way leaves no marker: the
    folder stays absent to readers, and a later publish overwrites what was uploaded."""
    names = (
        sorted(names)
        if names is not None
        else sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    )
    if marker not in names:
        raise FileNotFoundError(f"{local / marker}: the folder's marker was not written")
    remove(join(remote, marker))
    for name in names:
        if name != marker:
            upload(local / name, join(remote, name))
    upload(local / marker, join(remote, marker))


def cache_root() -> Path:
    """Where remote files are copied to be read locally (memory-mapped shards, checkpoints)."""
    return Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln")) / "remote"


def cache_path(remote: str, key: str = "") -> Path:
    """A local folder for a copy of `remote`, named like it; `key` (a content digest, an ETag)
    separates versions, so a changed object is never read from an old copy."""
    protocol = protocol_of(remote)
    digest = hashlib.sha256(f"{remote}\0{key}".encode()).hexdigest()[:16]
    return cache_root() / protocol / digest / (name_of(remote) or "root")


def fetch_file(url: str) -> Path:
    """A local copy of one remote object, in a folder named like its remote folder (readers name a
    text file's source after it). Keyed by the object's size and ETag; a copy of the wrong size is
    fetched again, and a fetch cut short never leaves a copy under the final name."""
    info = filesystem(url).info(url)
    key = f"{info.get('size')}:{info.get('ETag') or info.get('mtime') or ''}"
    target = cache_path(parent_of(url), key) / name_of(url)
    if target.is_file() and target.stat().st_size == info.get("size"):
        return target
    download_atomic(url, target)
    return target


def download_atomic(url: str, target: Path) -> None:
    """Download `url` to `target` under a temporary name, renamed when complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        download(url, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_output(out, marker: str) -> Iterator[Path]:
    """The folder a stage writes `out` through: `out` itself on local disk; for a remote `out`, a
    local staging folder published when the block succeeds, `marker` last (publish_folder)."""
    if not is_remote(out):
        yield Path(out)
        return
    local = Path(tempfile.mkdtemp(prefix="kiln-stage-"))
    try:
        yield local
        publish_folder(local, str(out), marker)
    finally:
        shutil.rmtree(local, ignore_errors=True)
