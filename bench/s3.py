"""Object-store throughput against the local disk, through kiln.storage (fsspec, s3fs).

Starts moto's S3 server on 127.0.0.1 (the server the tests use) and times, per round, with the
rounds alternating so load on the machine hits both alike:
- write: a local file written and fsynced vs the same bytes uploaded (kiln.storage.upload);
- read: the local file read back vs downloaded (kiln.storage.download) into the cache;
- checkpoint: CheckpointManager.save of a model's state on disk vs RemoteCheckpointManager.save
  to s3:// (manifest last), and the loads of each.
moto keeps objects in memory and speaks HTTP over loopback: the ratio measures what Kiln and the
S3 protocol add (HTTP, signing, multipart), not a network or a real store's disks.

    python bench/s3.py                    # 64 MiB file, 5 rounds
    python bench/s3.py --mib 256 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch
from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln import storage
from kiln.checkpoint import checkpoint_manager
from kiln.model import ModelConfig, build_model


def start_server():
    from moto.server import ThreadedMotoServer  # optional: pip install 'moto[server]'

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_local(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dim", type=int, default=512, help="model width for the checkpoint rounds")
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server, endpoint = start_server()
    storage.configure({"s3": {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}})
    bucket = f"s3://kiln-bench-{uuid.uuid4().hex[:8]}"
    storage.filesystem(bucket).mkdir(bucket[5:])
    data = os.urandom(args.mib << 20)
    model = build_model(ModelConfig(vocab_size=8192, dim=args.dim, n_layers=8, n_heads=8, max_seq_len=256))
    state = model.state_dict()
    ckpt_mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    cfg = model.cfg
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        os.environ["KILN_CACHE"] = str(tmp / "cache")
        local_ckpt, remote_ckpt = checkpoint_manager(tmp / "ckpt"), checkpoint_manager(f"{bucket}/ckpt")
        for r in range(args.rounds):
            url, path = f"{bucket}/blob-{r}", tmp / f"blob-{r}"
            times.setdefault("write local", []).append(timed(lambda: write_local(path, data)))
            times.setdefault("write s3", []).append(timed(lambda: storage.upload(path, url)))
            times.setdefault("read local", []).append(timed(lambda: path.read_bytes()))
            times.setdefault("read s3", []).append(timed(lambda: storage.download(url, tmp / f"back-{r}")))
            for name, manager in (("local", local_ckpt), ("s3", remote_ckpt)):
                times.setdefault(f"ckpt save {name}", []).append(
                    timed(lambda: manager.save(r + 1, cfg, state, {"loop": {}}, {"tokens_seen": 0}))
                )
                folder = storage.join(manager.root, f"step-{r + 1:08d}")
                times.setdefault(f"ckpt load {name}", []).append(timed(lambda: manager.load(folder)))
            path.unlink()
            (tmp / f"back-{r}").unlink()
    server.stop()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"file {args.mib} MiB, checkpoint {ckpt_mib:.0f} MiB of weights, {args.rounds} rounds (median)")
    for op in ("write", "read", "ckpt save", "ckpt load"):
        size = args.mib if op in ("write", "read") else ckpt_mib
        local, s3 = statistics.median(times[f"{op} local"]), statistics.median(times[f"{op} s3"])
        print(
            f"{op:10s} local {size / local:8.1f} MiB/s   s3 {size / s3:8.1f} MiB/s   "
            f"s3/local time {s3 / local:5.2f}x   rounds s3 {[round(t, 3) for t in times[f'{op} s3']]}"
        )


if __name__ == "__main__":
    main()
