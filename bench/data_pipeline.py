"""Data-curation throughput: Kiln vs datatrove on the same real text, same process, one core each.

MinHash signatures: Kiln's `minhash_dedup` index phase (shingle, 112 permutations, 14x8 band keys,
files written) against datatrove's `MinhashDedupSignature` (same 5-gram / 14x8 / seed 1 config, FineWeb's
64-bit sha1 shingle hash, signature files written and sorted). Both run single-process, so docs/s is per
core. Issue 3's target: Kiln / datatrove >= 2.0.

    python bench/data_pipeline.py minhash [--docs 5000]
    python bench/data_pipeline.py dedup-memory [--docs 1000000]   # peak RSS of index and resolve

datatrove needs `pip install -c constraints.txt datatrove spacy` (its English word tokenizer is spaCy's).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sysconfig
import tempfile
import time
from pathlib import Path


def real_texts(n: int, words: int = 300) -> list[str]:
    """Chunks of the Python standard library's files (real text), repeated in order if short."""
    chunks = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        toks = path.read_text(encoding="utf-8", errors="replace").split()
        chunks.extend(" ".join(toks[i:i + words]) for i in range(0, len(toks) - words, words))
        if len(chunks) >= n:
            break
    return [chunks[i % len(chunks)] for i in range(n)]


def kiln_minhash(texts: list[str]) -> float:
    from kiln.data.steps.dedup import MinhashDedup
    docs = [{"id": str(i), "text": t, "source": "bench", "meta": {}} for i, t in enumerate(texts)]
    step = MinhashDedup()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        step.index(iter(docs), Path(tmp), 0)
        return time.perf_counter() - start


def datatrove_minhash(texts: list[str]) -> float:
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.utils.hashing import HashConfig
    docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts)]
    # FineWeb's hash (sha1, 64-bit): datatrove 0.10's xxhash path passes str, which xxhash >= 4 rejects.
    config = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8, seed=1,
                           hash_config=HashConfig(precision=64, hash_fc="sha1"))
    with tempfile.TemporaryDirectory() as tmp:
        step = MinhashDedupSignature(output_folder=tmp, config=config, language="en")
        step.get_shingles("warm up the spaCy tokenizer")  # model load is not per-document work
        start = time.perf_counter()
        step.run(iter(docs), rank=0, world_size=1)
        return time.perf_counter() - start


def bench_minhash(n_docs: int) -> None:
    texts = real_texts(n_docs)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    kiln = min(kiln_minhash(texts) for _ in range(3))
    print(f"kiln      minhash signatures: {n_docs / kiln:9.0f} docs/s/core  ({mb / kiln:.1f} MB/s)")
    try:
        theirs = min(datatrove_minhash(texts) for _ in range(2))
    except ImportError as err:
        print(f"datatrove unavailable ({err}); no ratio")
        return
    print(f"datatrove minhash signatures: {n_docs / theirs:9.0f} docs/s/core  ({mb / theirs:.1f} MB/s)")
    print(f"ratio kiln/datatrove: {theirs / kiln:.2f}x  (target >= 2.0; {n_docs} docs, {mb:.1f} MB)")


def _short_docs(task: int, per_task: int, tasks: int) -> list[dict]:
    """20-word real-text documents, a different slice per task; every 10th document repeats one of
    another task's, so cross-task clusters exist (real code text also repeats on its own)."""
    texts = real_texts(per_task * tasks, words=20)
    mine = texts[task * per_task:(task + 1) * per_task]
    other = texts[((task + 1) % tasks) * per_task:]
    return [{"id": f"{task}-{i}", "text": other[i] if i % 10 == 0 else mine[i], "source": "b", "meta": {}}
            for i in range(per_task)]


def _index_task(args) -> int:
    from kiln.data.steps.dedup import MinhashDedup
    workdir, task, per_task, tasks = args
    MinhashDedup().index(iter(_short_docs(task, per_task, tasks)), Path(workdir), task)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _resolve(args) -> tuple[int, dict]:
    from kiln.data.steps.dedup import MinhashDedup
    workdir, tasks = args
    stats = MinhashDedup().resolve(Path(workdir), tasks)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, stats


def bench_dedup_memory(n_docs: int, tasks: int = 8) -> None:
    ctx = mp.get_context("spawn")  # fresh processes: each peak RSS is that phase's alone
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with ctx.Pool(1) as pool:
            index_rss = max(pool.map(_index_task, [(tmp, t, n_docs // tasks, tasks) for t in range(tasks)], chunksize=1))
        mid = time.perf_counter()
        with ctx.Pool(1) as pool:
            resolve_rss, stats = pool.apply(_resolve, ((tmp, tasks),))
        end = time.perf_counter()
    print(f"minhash dedup of {n_docs} short docs in {tasks} tasks: index {mid - start:.1f} s "
          f"(peak RSS {index_rss / 1024:.0f} MiB per task), resolve {end - mid:.1f} s "
          f"(peak RSS {resolve_rss / 1024:.0f} MiB); {stats}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["minhash", "dedup-memory"])
    parser.add_argument("--docs", type=int, default=None)
    args = parser.parse_args()
    if args.what == "minhash":
        bench_minhash(args.docs or 5000)
    else:
        bench_dedup_memory(args.docs or 1_000_000)
