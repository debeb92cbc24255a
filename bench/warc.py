"""WARC to text: Kiln's reader (both extractors) against datatrove's WarcReader + Trafilatura, on one
core, on the same real crawl, in the same run; and how well each extractor finds the main text.

The crawl is kiln.data.warc_demo's: pages of the Python 3.11 manual and Debian's Chinese reference
and FAQ, as Debian packages ship them (`apt-get install python3.11-doc debian-reference-zh-cn
debian-faq-zh-cn`). Speed is pages of text out per second of wall time, one process at a time
(datatrove's extractor runs in a sandbox subprocess, but the reader waits for it, so one core is
busy at a time), best of `--repeat` passes.

Quality needs no hand labels: these pages are generated from markup that marks their main text
(Sphinx's `<div role="main">`; DocBook's pages are everything but the `navheader`/`navfooter`
bars), so the reference text of a page is that element's text. Over word multisets (lowercased
runs of letters and digits, each CJK character a word), per page: precision (1 - boilerplate
words kept) and recall (1 - main-text words lost), averaged over pages.

    python bench/warc.py [--python-pages 40] [--repeat 1] [--datatrove-timeout 10]

datatrove needs `pip install datatrove faust-cchardet python-magic` (and the libmagic1 package).
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.data.warc import EXTRACTORS, read_warc
from kiln.data.warc_demo import build_demo_warc

WORD = re.compile(r"[\u3400-\u9fff]|[^\W_]+")


def words(text: str) -> Counter:
    return Counter(w.lower() for w in WORD.findall(text))


def reference_texts(path: Path) -> dict[str, str]:
    """URL -> the page's main text, from the element its generator marks as main."""
    import lxml.html
    from warcio.archiveiterator import ArchiveIterator

    out = {}
    with open(path, "rb") as fh:
        for record in ArchiveIterator(fh):
            if record.rec_type != "response" or "html" not in (record.http_headers.get_header("Content-Type") or ""):
                continue
            tree = lxml.html.fromstring(record.content_stream().read())
            main = tree.xpath('//div[@role="main"]')
            if main:
                node = main[0]
            else:
                node = tree.find("body")
                for bar in node.xpath('.//div[@class="navheader" or @class="navfooter"]'):
                    bar.getparent().remove(bar)
            for junk in node.xpath(".//script|.//style|.//a[@class='headerlink']"):
                junk.getparent().remove(junk)
            out[record.rec_headers.get_header("WARC-Target-URI")] = node.text_content()
    return out


def quality(texts: dict[str, str], reference: dict[str, str]) -> tuple[float, float, int]:
    """Mean precision and recall of word multisets over the reference pages, and pages missed."""
    precision, recall, missed = [], [], 0
    for url, ref in reference.items():
        ref_words = words(ref)
        got = words(texts.get(url, ""))
        if not got:
            missed += 1
        common = sum((got & ref_words).values())
        precision.append(common / max(1, sum(got.values())))
        recall.append(common / max(1, sum(ref_words.values())))
    return sum(precision) / len(precision), sum(recall) / len(recall), missed


def kiln_pass(path: Path, extractor: str) -> tuple[float, dict[str, str]]:
    start = time.perf_counter()
    texts = {d["meta"]["url"]: d["text"] for d, _ in read_warc(path, "crawl", path.name, extractor) if d}
    return time.perf_counter() - start, texts


def datatrove_pass(path: Path, timeout: float) -> tuple[float, dict[str, str]]:
    from datatrove.pipeline.extractors import Trafilatura
    from datatrove.pipeline.readers import WarcReader

    reader = WarcReader(str(path.parent), glob_pattern=path.name)
    extractor = Trafilatura(timeout=timeout)  # FineWeb's settings otherwise: favour_precision, deduplicate
    start = time.perf_counter()
    texts = {d.metadata["url"]: d.text for d in extractor.run(reader.run(None, rank=0, world_size=1))}
    return time.perf_counter() - start, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python-pages", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--datatrove-timeout", type=float, default=10.0, help="seconds per page (datatrove's default 1)"
    )
    args = parser.parse_args()
    print(cpu_line())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "crawl.warc.gz"
        counts = build_demo_warc(path, python_pages=args.python_pages)
        size = path.stat().st_size / 1e6
        print(f"crawl: {counts['html']} HTML pages, {size:.1f} MB gzipped")
        reference = reference_texts(path)
        results = {}
        for name in EXTRACTORS:
            seconds, texts = min((kiln_pass(path, name) for _ in range(args.repeat)), key=lambda r: r[0])
            results[f"kiln + {name}"] = (seconds, texts)
        try:
            runs = [datatrove_pass(path, args.datatrove_timeout) for _ in range(args.repeat)]
            results["datatrove WarcReader + Trafilatura"] = min(runs, key=lambda r: r[0])
        except ImportError as err:
            print(f"datatrove unavailable ({err}); no ratio")
        print(f"{'reader':<38} {'pages':>5} {'pages/s/core':>12} {'precision':>9} {'recall':>7} {'missed':>6}")
        for label, (seconds, texts) in results.items():
            p, r, missed = quality(texts, reference)
            print(f"{label:<38} {len(texts):>5} {len(texts) / seconds:>12.2f} {p:>9.3f} {r:>7.3f} {missed:>6}")
        peer = results.get("datatrove WarcReader + Trafilatura")
        if peer:
            for name in EXTRACTORS:
                seconds, texts = results[f"kiln + {name}"]
                ratio = (len(texts) / seconds) / (len(peer[1]) / peer[0])
                print(f"ratio kiln + {name} / datatrove: {ratio:.2f}x pages/s")


if __name__ == "__main__":
    main()
