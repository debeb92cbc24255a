"""Token shards on object stores: the loader memory-maps shards, which a remote object cannot be,
so a remote pack is copied to the local cache on first read and each shard checked against the
sha256 its header records (kiln.data.pack writes it), at every load: a cached copy that went bad
is fetched again, never trained on. A pack is published with its stats.json last; a remote pack
folder without it is not (yet) a pack."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kiln import storage
from kiln.checkpoint import sha256_file
from kiln.errors import DataError

MARKER = "stats.json"
SPLITS = ("train", "val")


def local_pack(pack_dir: str) -> Path:
    """A local copy of the published remote pack `pack_dir`, every shard verified."""
    root = pack_dir.rstrip("/")
    marker = storage.join(root, MARKER)
    if not storage.isfile(marker):
        raise DataError(f"{marker}: missing; {root} is not a published pack (run the pack stage first)")
    stats = storage.read_bytes(marker)
    local = storage.cache_path(root, hashlib.sha256(stats).hexdigest())
    for name in ("mixture.json", MARKER):
        if storage.isfile(storage.join(root, name)):
            storage.download_atomic(storage.join(root, name), local / name)
    for split in SPLITS:
        for header_url in storage.glob(storage.join(root, split, "*.json")):
            _fetch_shard(header_url, local / split)
    return local


def _fetch_shard(header_url: str, folder: Path) -> None:
    header_path = folder / storage.name_of(header_url)
    storage.download_atomic(header_url, header_path)
    try:
        expected = json.loads(header_path.read_text()).get("sha256")
    except (json.JSONDecodeError, AttributeError) as err:
        raise DataError(f"{header_url}: unreadable shard header ({err})") from None
    bin_url = header_url[: -len(".json")] + ".bin"
    if not isinstance(expected, str):
        raise DataError(f"{header_url}: no sha256 of its shard; repack with this Kiln to read it from {bin_url}")
    bin_path = header_path.with_suffix(".bin")
    for attempt in (0, 1):
        if not bin_path.is_file() or attempt:
            storage.download_atomic(bin_url, bin_path)
        if sha256_file(bin_path) == expected:
            return
    bin_path.unlink()
    raise DataError(f"{bin_url}: sha256 does not match its header (corrupted shard)")
