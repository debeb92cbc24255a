"""Data-curation throughput: Kiln vs datatrove on the same real text, one core each.

MinHash signatures: Kiln's `minhash_dedup` index phase (shingle, 112 permutations, 14x8 band keys,
files written) against datatrove's `MinhashDedupSignature` (same 5-gram / 14x8 / seed 1 config, FineWeb's
64-bit sha1 shingle hash, signature files written and sorted). Both run single-process, so docs/s is per
core. Issue 3's target: Kiln / datatrove >= 2.0.

Filter chain: Kiln's heuristic filters (gopher_quality, gopher_repetition, c4, fineweb at their
defaults, run by the executor's per-document loop) against datatrove's GopherQualityFilter,
GopherRepetitionFilter, C4QualityFilter and FineWebQualityFilter given the same parameters, on the
prose sources of Kiln's built-in corpus. Each side runs in its own process; timed runs alternate
between them. Issue 3's target: Kiln / datatrove >= 1.0.

    python bench/data_pipeline.py minhash [--docs 5000]
    python bench/data_pipeline.py chain [--docs N] [--repeats 3] [--per-filter]
    python bench/data_pipeline.py dedup-memory [--docs 1000000]   # peak RSS of index and resolve

datatrove needs `pip install -c constraints.txt datatrove spacy` (its English word tokenizer is spaCy's).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import multiprocessing as mp
import os
import resource
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

from machine import cpu_line  # bench/ (the script's folder, on sys.path)


def real_texts(n: int, words: int = 300) -> list[str]:
    """Chunks of the Python standard library's files (real text), repeated in order if short."""
    chunks = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        toks = path.read_text(encoding="utf-8", errors="replace").split()
        chunks.extend(" ".join(toks[i : i + words]) for i in range(0, len(toks) - words, words))
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
    config = MinhashConfig(
        n_grams=5, num_buckets=14, hashes_per_bucket=8, seed=1, hash_config=HashConfig(precision=64, hash_fc="sha1")
    )
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
    mine = texts[task * per_task : (task + 1) * per_task]
    other = texts[((task + 1) % tasks) * per_task :]
    return [
        {"id": f"{task}-{i}", "text": other[i] if i % 10 == 0 else mine[i], "source": "b", "meta": {}}
        for i in range(per_task)
    ]


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
            index_rss = max(
                pool.map(_index_task, [(tmp, t, n_docs // tasks, tasks) for t in range(tasks)], chunksize=1)
            )
        mid = time.perf_counter()
        with ctx.Pool(1) as pool:
            resolve_rss, stats = pool.apply(_resolve, ((tmp, tasks),))
        end = time.perf_counter()
    print(
        f"minhash dedup of {n_docs} short docs in {tasks} tasks: index {mid - start:.1f} s "
        f"(peak RSS {index_rss / 1024:.0f} MiB per task), resolve {end - mid:.1f} s "
        f"(peak RSS {resolve_rss / 1024:.0f} MiB); {stats}"
    )


# --------------------------------------------------------------------------------------------------
# Heuristic filter chain

CHAIN_SOURCES = ("python_docs", "debian_docs")
CHAIN_STEPS = ("gopher_quality", "gopher_repetition", "c4", "fineweb")


def prose_documents(max_bytes_per_source: int = 2_500_000) -> list[dict]:
    """Prose from Kiln's built-in corpus, read as `kiln corpus` reads it (default CorpusConfig, seed 0):
    all of python_docs (reference-manual topics, module docstrings, the stdlib's .txt files) and
    debian_docs without its copyright files (mostly file lists), i.e. changelogs, NEWS, READMEs and
    package manuals, each source cut at `max_bytes_per_source`. Documents alternate between the two
    sources; every text is normalised by Kiln's `normalize`, as `kiln data` does before its filters.
    Stdlib source code is left out: these are prose rules."""
    from kiln.data.config import CorpusConfig
    from kiln.data.corpus import collect_source
    from kiln.data.steps.normalize import normalize_text

    per_source = []
    for name in CHAIN_SOURCES:
        docs: list[dict] = []
        # Read past the cap: the copyright files dropped below would otherwise use up the budget.
        collect_source(
            name,
            CorpusConfig(sources=[name], max_bytes_per_source=3 * max_bytes_per_source),
            docs.append,
            lambda rejected: None,
        )
        kept, size = [], 0
        for d in docs:
            if Path(d["meta"]["path"]).name.lower().startswith("copyright"):
                continue
            if size >= max_bytes_per_source:
                break
            kept.append(d)
            size += len(d["text"].encode("utf-8"))
        per_source.append(kept)
    mixed = [d for pair in itertools.zip_longest(*per_source) for d in pair if d is not None]
    for d in mixed:
        d["text"] = normalize_text(d["text"])[0]
    return mixed


def kiln_chain() -> list:
    from kiln.data.steps.base import build_step

    return [build_step(name, {}, f"data.params.{name}") for name in CHAIN_STEPS]


def datatrove_chain() -> list:
    """datatrove's four filters with Kiln's default values wherever datatrove has the parameter.

    datatrove cannot switch its newline-per-word rule off (None fails), so it gets an infinite
    threshold, matching Kiln's default (off); its word split is cached and shared with the other
    rules, so that costs it nothing except after C4 rewrote a page."""
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    from kiln.data.steps.text import STOP_WORDS

    gq, gr, c4, fw = kiln_chain()
    newline_ratio = math.inf if fw.max_newline_word_ratio is None else fw.max_newline_word_ratio
    return [
        GopherQualityFilter(
            min_doc_words=gq.min_doc_words,
            max_doc_words=gq.max_doc_words,
            min_avg_word_length=gq.min_avg_word_length,
            max_avg_word_length=gq.max_avg_word_length,
            max_symbol_word_ratio=gq.max_symbol_word_ratio,
            max_bullet_lines_ratio=gq.max_bullet_lines_ratio,
            max_ellipsis_lines_ratio=gq.max_ellipsis_lines_ratio,
            max_non_alpha_words_ratio=gq.min_alpha_words_ratio,
            min_stop_words=gq.min_stop_words,
            stop_words=sorted(STOP_WORDS["en"]),
            language="en",
        ),
        GopherRepetitionFilter(
            dup_line_frac=gr.max_dup_line_fraction,
            dup_para_frac=gr.max_dup_paragraph_fraction,
            dup_line_char_frac=gr.max_dup_line_char_fraction,
            dup_para_char_frac=gr.max_dup_paragraph_char_fraction,
            top_n_grams=tuple((int(n), v) for n, v in gr.top_ngram_max_fractions.items()),
            dup_n_grams=tuple((int(n), v) for n, v in gr.dup_ngram_max_fractions.items()),
            language="en",
        ),
        C4QualityFilter(
            remove_citations=c4.remove_citations,
            filter_no_terminal_punct=c4.filter_no_terminal_punct,
            min_num_sentences=c4.min_sentences,
            min_words_per_line=c4.min_words_per_line,
            max_word_length=c4.max_word_length,
            filter_lorem_ipsum=c4.filter_lorem_ipsum,
            filter_javascript=c4.filter_javascript,
            filter_curly_bracket=c4.filter_curly_bracket,
            filter_policy=c4.filter_policy,
            language="en",
        ),
        FineWebQualityFilter(
            line_punct_thr=fw.min_line_punct_ratio,
            stop_chars=tuple(fw.end_marks),
            short_line_thr=fw.max_short_line_ratio,
            short_line_length=fw.short_line_length,
            char_duplicates_ratio=fw.max_dup_line_char_ratio,
            new_line_ratio=newline_ratio,
            language="en",
        ),
    ]


def machine_busy_seconds() -> float:
    """CPU seconds all processes on this machine have used since boot (Linux; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


_WORKER: dict = {}


def _chain_init(side: str, docs: list[dict]) -> None:
    _WORKER.update(side=side, docs=docs)


def _chain_pass(docs: list[dict], only: int | None = None) -> dict:
    """One timed pass of this worker's side over `docs` (the whole chain, or its step `only` alone):
    seconds, other processes' CPU use, documents kept and per-step counts."""
    pick = (lambda steps: steps) if only is None else (lambda steps: steps[only : only + 1])
    if _WORKER["side"] == "kiln":
        from kiln.data.executor import _run_steps  # the per-document loop `kiln data` runs

        steps = pick(kiln_chain())
        batch = [{**d, "meta": {"lang": "en"}} for d in docs]  # fresh dicts: c4 rewrites kept texts
        rejected: list[dict] = []
        stream = _run_steps(batch, steps, rejected)
    else:
        from datatrove.data import Document

        steps = pick(datatrove_chain())
        stream = iter([Document(text=d["text"], id=d["id"]) for d in docs])
        for step in steps:
            stream = step.run(stream, rank=0, world_size=1)
    machine, ours = machine_busy_seconds(), sum(os.times()[:2])
    start = time.perf_counter()
    kept = sum(1 for _ in stream)
    wall = time.perf_counter() - start
    others = (machine_busy_seconds() - machine) - (sum(os.times()[:2]) - ours)
    if _WORKER["side"] == "kiln":
        per_step = [(s.name, s.stats.docs_in, s.stats.docs_out, s.stats.seconds, dict(s.stats.reasons)) for s in steps]
    else:
        per_step = []
        for s in steps:
            counts = {k: int(v.total) for k, v in s.stats.stats.items()}
            reasons = {k.removeprefix("dropped_"): n for k, n in counts.items() if k.startswith("dropped_")}
            per_step.append(
                (
                    type(s).__name__,
                    counts.get("total", 0),
                    counts.get("forwarded", 0),
                    s.stats.time_stats.total,
                    reasons,
                )
            )
    return {"seconds": wall, "others": max(others, 0.0) / wall, "kept": kept, "steps": per_step}


def _chain_warm() -> None:
    # Imports, regex compilation and datatrove's spaCy model load are per-process costs, not
    # per-document work. The warm-up texts are altered so datatrove's small cache of word splits
    # (keyed by text) holds nothing the timed passes could reuse.
    _chain_pass([{**d, "text": d["text"] + "\nWarm-up line."} for d in _WORKER["docs"][:20]])


def _chain_timed(only: int | None = None) -> dict:
    return _chain_pass(_WORKER["docs"], only)


def bench_chain(n_docs: int | None, repeats: int, per_filter: bool) -> None:
    docs = prose_documents()[:n_docs]
    n, mb = len(docs), sum(len(d["text"].encode()) for d in docs) / 1e6
    missing = [m for m in ("datatrove", "spacy") if importlib.util.find_spec(m) is None]
    sides = ["kiln"] if missing else ["kiln", "datatrove"]
    if missing:
        print(f"{' and '.join(missing)} not installed; Kiln alone, no ratio")
    print(
        f"filter chain {' -> '.join(CHAIN_STEPS)} on {n} documents ({mb:.2f} MB) of "
        f"{' + '.join(CHAIN_SOURCES)}, normalised, lang en; {repeats} timed passes per side, alternating"
    )
    ctx = mp.get_context("spawn")  # one process per side: neither carries the other's imports or heap
    pools = {side: ctx.Pool(1, initializer=_chain_init, initargs=(side, docs)) for side in sides}
    results: dict[str, list[dict]] = {side: [] for side in sides}
    try:
        for side in sides:  # one after the other, so neither warm-up overlaps a timed pass
            pools[side].apply(_chain_warm)
        for r in range(repeats):
            for side in sides if r % 2 == 0 else sides[::-1]:
                results[side].append(pools[side].apply(_chain_timed))
        if per_filter:  # every filter alone on the whole input: one pass per side and filter
            alone = {side: [pools[side].apply(_chain_timed, (i,)) for i in range(len(CHAIN_STEPS))] for side in sides}
    finally:
        for pool in pools.values():
            pool.terminate()
    for side in sides:
        rates = [n / res["seconds"] for res in results[side]]
        last = results[side][-1]
        busy = ", ".join(f"{res['others']:.2f}" for res in results[side])
        print(
            f"{side:9s} docs/s/core: median {statistics.median(rates):7.0f}  range {min(rates):.0f}-{max(rates):.0f}"
            f"  ({statistics.median(rates) * mb / n:.2f} MB/s); kept {last['kept']}/{n} ({last['kept'] / n:.0%});"
            f" other processes' CPU per pass: {busy} cores"
        )
        for name, d_in, d_out, secs, reasons in last["steps"]:
            top = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
            print(f"    {name:22s} {d_in:5d} -> {d_out:5d}  {secs:6.2f} s  {top}")
    if len(sides) == 2:
        kiln = [res["seconds"] for res in results["kiln"]]
        theirs = [res["seconds"] for res in results["datatrove"]]
        pairs = [t / k for k, t in zip(kiln, theirs)]
        print(
            f"ratio kiln/datatrove: {statistics.median(theirs) / statistics.median(kiln):.2f}x"
            f"  (medians; per pass {', '.join(f'{p:.2f}' for p in pairs)}; target >= 1.0)"
        )
    if per_filter:
        print(f"each filter alone on all {n} documents (one pass per side):")
        for i, name in enumerate(CHAIN_STEPS):
            row = f"    {name:18s}"
            for side in sides:
                res = alone[side][i]
                row += (
                    f"  {side} {n / res['seconds']:7.0f} docs/s, keeps {res['kept']:4d}"
                    f" (others {res['others']:.2f} cores)"
                )
            if len(sides) == 2:
                row += f"  ratio {alone['datatrove'][i]['seconds'] / alone['kiln'][i]['seconds']:.2f}x"
            print(row)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["minhash", "chain", "dedup-memory"])
    parser.add_argument("--docs", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="chain: timed passes per side")
    parser.add_argument("--per-filter", action="store_true", help="chain: also time each filter alone")
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    if args.what == "minhash":
        bench_minhash(args.docs or 5000)
    elif args.what == "chain":
        bench_chain(args.docs, args.repeats, args.per_filter)
    else:
        bench_dedup_memory(args.docs or 1_000_000)
