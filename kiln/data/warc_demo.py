"""Build a small real crawl: a WARC of the HTML pages that Debian documentation packages ship.

    python -m kiln.data.warc_demo crawl/debian-html.warc.gz [--python-pages 120]

The pages are real documentation, written by people, in English and Chinese:

| package | pages | URL given | licence |
|---|---|---|---|
| python3.11-doc | /usr/share/doc/python3.11/html/**.html | https://docs.python.org/3.11/... | PSF License v2 |
| debian-reference-zh-cn | /usr/share/debian-reference/*.zh-cn.html | https://www.debian.org/doc/manuals/debian-reference/... | GPL-2+ |
| debian-faq-zh-cn | /usr/share/doc/debian/FAQ/zh-cn/*.html | https://www.debian.org/doc/manuals/debian-faq/... | SPI verbatim-copying permission |

The crawl holds what a real one holds besides pages: a `warcinfo` record, a `request` record,
plain-text responses (the Python docs' reST sources, `text/plain`) and pages whose charset is
declared only in the HTML, or nowhere: two Chinese FAQ pages are re-encoded as GB18030, one with
its `<meta charset>` rewritten and one with it removed (only a detector can read that one).
Responses carry `WARC-Identified-Payload-Type` as Common Crawl's do
(`application/xhtml+xml` for DocBook's XHTML pages). Every record's date is its file's modification time and its id a UUID5 of its URL, so the same
packages give the same bytes.
"""

from __future__ import annotations

import argparse
import io
import re
import uuid
from datetime import datetime, timezone
from pathlib import Path

from kiln.errors import DataError

PYTHON_HTML = Path("/usr/share/doc/python3.11/html")
DEBIAN_REFERENCE = Path("/usr/share/debian-reference")
DEBIAN_FAQ = Path("/usr/share/doc/debian/FAQ/zh-cn")
PACKAGES = "python3.11-doc debian-reference-zh-cn debian-faq-zh-cn"
CRAWL_DATE = "2026-01-01T00:00:00Z"  # the warcinfo record's date
GB_META = re.compile(rb'<meta http-equiv="Content-Type" content="text/html; charset=UTF-8" */?>', re.IGNORECASE)


def _pages(python_pages: int) -> list[tuple[Path, str, str]]:
    """(file, URL, Content-Type header) of every page, in a fixed order."""
    python = sorted(p for p in PYTHON_HTML.rglob("*.html") if "_static" not in p.parts)
    if python_pages < len(python):
        step = len(python) / python_pages  # evenly spread, so every part of the manual is in
        python = [python[int(i * step)] for i in range(python_pages)]
    pages = [
        (p, f"https://docs.python.org/3.11/{p.relative_to(PYTHON_HTML).as_posix()}", "text/html; charset=utf-8")
        for p in python
    ]
    pages += [
        (p, f"https://www.debian.org/doc/manuals/debian-reference/{p.name}", "text/html; charset=utf-8")
        for p in sorted(DEBIAN_REFERENCE.glob("*.zh-cn.html"))
    ]
    # The FAQ's header names no charset: the page's own <meta> declaration has to be found.
    pages += [
        (p, f"https://www.debian.org/doc/manuals/debian-faq/{p.name}", "text/html")
        for p in sorted(DEBIAN_FAQ.glob("*.html"))
    ]
    return pages


def _date(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_demo_warc(out: str | Path, python_pages: int = 120) -> dict:
    """Write the crawl to `out` (gzip per record when it ends in .gz); returns counts by kind."""
    from warcio.statusandheaders import StatusAndHeaders  # optional dependency: pip install warcio
    from warcio.warcwriter import WARCWriter

    if not PYTHON_HTML.is_dir() or not DEBIAN_FAQ.is_dir() or not DEBIAN_REFERENCE.is_dir():
        raise DataError(f"the demo crawl is built from Debian's HTML documentation: apt-get install {PACKAGES}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    counts = {"html": 0, "text_plain": 0, "gb18030": 0, "request": 0}
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as fh:
        writer = WARCWriter(fh, gzip=out.name.endswith(".gz"))

        def write(url: str, kind: str, body: bytes, content_type: str | None, date: str) -> None:
            http = None
            if kind == "response":
                http = StatusAndHeaders("200 OK", [("Content-Type", content_type)], protocol="HTTP/1.1")
            elif kind == "request":
                http = StatusAndHeaders(f"GET {url} HTTP/1.1", [("Host", url.split("/")[2])], is_http_request=True)
            record_id = f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, kind + ':' + url)}>"
            headers = {"WARC-Date": date, "WARC-Record-ID": record_id}
            if kind == "response":
                # As Common Crawl records it: the type sniffed from the payload (DocBook's pages are XHTML).
                sniffed = content_type.split(";")[0]
                headers["WARC-Identified-Payload-Type"] = (
                    "application/xhtml+xml" if b"xmlns" in body[:1024] else sniffed
                )
            writer.write_record(
                writer.create_warc_record(
                    url, kind, payload=io.BytesIO(body), http_headers=http, warc_headers_dict=headers
                )
            )

        info = writer.create_warcinfo_record(out.name, {"software": "kiln.data.warc_demo", "packages": PACKAGES})
        info.rec_headers.replace_header("WARC-Date", CRAWL_DATE)
        writer.write_record(info)
        pages = _pages(python_pages)
        first_url = pages[0][1]
        write(first_url, "request", b"", None, _date(pages[0][0]))
        counts["request"] += 1
        faq_pages = [p for p in pages if p[0].parent == DEBIAN_FAQ]
        gb_meta, gb_bare = faq_pages[1][0], faq_pages[2][0]
        for path, url, content_type in pages:
            body = path.read_bytes()
            if path in (gb_meta, gb_bare):
                body = body.decode("utf-8").encode("gb18030")
                replacement = b'<meta charset="gb18030" />' if path == gb_meta else b""
                body = GB_META.sub(replacement, body)
                counts["gb18030"] += 1
            write(url, "response", body, content_type, _date(path))
            counts["html"] += 1
        for source in sorted((PYTHON_HTML / "_sources" / "tutorial").glob("*.txt"))[:2]:
            url = f"https://docs.python.org/3.11/_sources/tutorial/{source.name}"
            write(url, "response", source.read_bytes(), "text/plain; charset=utf-8", _date(source))
            counts["text_plain"] += 1
    tmp.replace(out)
    return counts


def ensure_demo_crawl(path: Path, python_pages: int = 120) -> bool:
    """Build the demo crawl at path unless it exists (data.demo_crawl); True when it was built."""
    if path.exists():
        return False
    print(f"[data] {path} does not exist: building the demo crawl from Debian's HTML (kiln.data.warc_demo)")
    counts = build_demo_warc(path, python_pages)
    print(f"[data] {path}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.data.warc_demo", description=__doc__.split("\n")[0])
    parser.add_argument("out", help="the WARC to write (.warc.gz: one gzip member per record)")
    parser.add_argument("--python-pages", type=int, default=120, help="pages of the Python manual (of 500+)")
    args = parser.parse_args(argv)
    try:
        counts = build_demo_warc(args.out, args.python_pages)
    except DataError as err:
        print(f"error: {err}")
        return 2
    print(f"{args.out}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
