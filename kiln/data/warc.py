"""Read web crawls: WARC files (`.warc`, `.warc.gz`) of raw HTML to documents of main text.

Each `response` record whose HTTP `Content-Type` is HTML becomes a document: the payload is decoded
(charset from the HTTP header, then the page's own `<meta charset>`, then charset-normalizer's
detector), its main text is extracted with trafilatura or resiliparse, and `meta` keeps the URL
(`WARC-Target-URI`), the crawl date (`WARC-Date`), the charset used and the record's byte offset.
Other record types (warcinfo, request, metadata, revisit) hold no page and are skipped.

A record that does not become a document is a rejection `{"file", "line", "offset", "reason",
"raw"}`: `line` is the record's 1-based number in the file, `offset` the byte offset of its
record (its gzip member in a `.warc.gz`), so `warcio extract FILE OFFSET` shows it. Reasons:

- `not_html`: a response whose Content-Type is not HTML (an image, a PDF, plain text);
- `no_http_headers`: a response without a parseable HTTP status line and headers;
- `decode_failure`: no candidate charset decodes the payload;
- `extraction_empty`: the extractor found no main text (a redirect page, a page of navigation);
- `corrupt_record`: the gzip member or the WARC headers are damaged. The read resumes at the next
  gzip member (`.warc.gz`) or the next `WARC/1.x` line (`.warc`), so one damaged record costs
  that record, not the rest of the crawl.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from typing import Iterator

from kiln.errors import ConfigError

EXTRACTORS = ("trafilatura", "resiliparse")
DEFAULT_EXTRACTOR = "resiliparse"  # docs/crawl.md: an order of magnitude faster than trafilatura, as accurate
WARC_SUFFIXES = (".warc", ".warc.gz")
PREVIEW_BYTES = 200  # of a bad record, enough to recognise it in rejected/
META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9._:-]+)""", re.IGNORECASE)
SNIFF_BYTES = 4096  # browsers look for <meta charset> in the first 1024 bytes; some pages put it later
GZIP_MAGIC = b"\x1f\x8b\x08"
WARC_MAGIC = b"WARC/1."


def is_warc(path: Path | str) -> bool:
    return str(path).lower().endswith(WARC_SUFFIXES)


def check_extractor(name: str, installed: bool = True) -> None:
    """For configs: the name is known (and its package imports); else a ConfigError naming the key."""
    if name not in EXTRACTORS:
        raise ConfigError("html_extractor", f"must be one of {', '.join(EXTRACTORS)}, got {name!r}")
    if not installed:
        return
    try:
        _extractor(name)
    except ImportError:
        raise ConfigError("html_extractor", f"{name!r} is not installed: pip install {name}") from None


def _extractor(name: str):
    """text = f(html, url) for the named extractor; the package is imported on first use."""
    if name == "trafilatura":
        import trafilatura

        def extract(html: str, url: str) -> str:
            # Tables kept: reference pages put much of their content in them; comments are boilerplate.
            # fast: no second opinion from justext/readability, which on the demo crawl cost 2.4x the
            # time and lost words (recall 0.83 against 0.85, docs/crawl.md).
            return trafilatura.extract(html, url=url, include_comments=False, include_tables=True, fast=True) or ""

        return extract
    if name == "resiliparse":
        from resiliparse.extract.html2text import extract_plain_text
        from resiliparse.parse.html import HTMLTree

        def extract(html: str, url: str) -> str:
            return extract_plain_text(HTMLTree.parse(html), main_content=True, alt_texts=False)

        return extract
    raise ValueError(f"unknown html extractor {name!r}")


def header_charset(content_type: str | None) -> str | None:
    match = re.search(r"charset\s*=\s*[\"']?([A-Za-z0-9._:-]+)", content_type or "", re.IGNORECASE)
    return match.group(1) if match else None


def decode_html(payload: bytes, content_type: str | None) -> tuple[str | None, str | None]:
    """(text, charset) of an HTML payload, (None, None) when no candidate decodes it.

    Candidates in order: a byte-order mark, the HTTP header's charset, the page's `<meta charset>`
    or `http-equiv` declaration, then charset-normalizer's guess. A declared charset that is
    unknown or does not decode the bytes strictly is passed over rather than trusted: crawls are
    full of pages whose declaration is wrong.
    """
    if payload.startswith(b"\xef\xbb\xbf"):
        candidates = ["utf-8-sig"]
    else:
        meta = META_CHARSET.search(payload[:SNIFF_BYTES])
        candidates = [c for c in (header_charset(content_type), meta and meta.group(1).decode("ascii")) if c]
    for charset in candidates:
        try:
            return payload.decode(charset), charset.lower()
        except (LookupError, UnicodeDecodeError):
            continue
    from charset_normalizer import from_bytes  # optional dependency of the data extra, heavy to import

    best = from_bytes(payload).best()
    if best is None:
        return None, None
    return str(best), best.encoding


def _preview(data: bytes) -> str:
    return data[:PREVIEW_BYTES].decode("utf-8", errors="replace")


def _rejection(path: Path, number: int, offset: int, reason: str, raw: bytes | str) -> dict:
    raw = _preview(raw) if isinstance(raw, bytes) else raw[:PREVIEW_BYTES]
    return {"file": str(path), "line": number, "offset": offset, "reason": reason, "raw": raw}


def _resync(path: Path, after: int, magic: bytes) -> int | None:
    """The offset of the next record start (gzip member or WARC/1.x line) after `after`, or None."""
    with open(path, "rb") as fh:
        fh.seek(after + 1)
        position, tail = after + 1, b""
        while chunk := fh.read(1 << 20):
            found = (tail + chunk).find(magic)
            if found >= 0:
                return position - len(tail) + found
            tail = chunk[-(len(magic) - 1) :]
            position += len(chunk)
    return None


def read_warc(
    path: str | Path, source: str, name: str, html_extractor: str = DEFAULT_EXTRACTOR
) -> Iterator[tuple[dict | None, dict | None]]:
    """(document, None) for each HTML page of a WARC file, (None, rejection) for each bad record."""
    from warcio.archiveiterator import ArchiveIterator  # optional dependency: pip install warcio
    from warcio.exceptions import ArchiveLoadFailed

    path = Path(path)
    extract = _extractor(html_extractor)
    magic = GZIP_MAGIC if str(path).lower().endswith(".gz") else WARC_MAGIC
    errors = (ArchiveLoadFailed, OSError, EOFError, zlib.error, ValueError)
    start, number = 0, 0
    while start is not None:
        with open(path, "rb") as fh:
            fh.seek(start)
            records = ArchiveIterator(fh)
            offset = start
            try:
                for record in records:
                    offset = records.offset  # the start of this record, before its payload is read
                    number += 1
                    if record.rec_type != "response":
                        continue
                    yield _page(record, path, number, offset, source, name, extract)
                start = None
            except errors as err:
                # A member that fails to open fails after read_to_end moved records.offset to it.
                offset = max(offset, records.offset)
                number += 1
                yield None, _rejection(path, number, offset, "corrupt_record", f"{type(err).__name__}: {err}")
                start = _resync(path, offset, magic)


def _page(record, path: Path, number: int, offset: int, source: str, name: str, extract) -> tuple:
    headers = record.http_headers
    payload = record.content_stream().read()
    if headers is None or not headers.get_statuscode():
        return None, _rejection(path, number, offset, "no_http_headers", payload)
    content_type = headers.get_header("Content-Type") or ""
    if "html" not in content_type.split(";")[0].lower():
        return None, _rejection(path, number, offset, "not_html", f"Content-Type: {content_type}")
    url = record.rec_headers.get_header("WARC-Target-URI") or ""
    html, charset = decode_html(payload, content_type)
    if html is None:
        return None, _rejection(path, number, offset, "decode_failure", payload)
    text = extract(html, url)
    if not text or not text.strip():
        return None, _rejection(path, number, offset, "extraction_empty", f"{url} ({len(payload)} bytes of HTML)")
    record_id = (record.rec_headers.get_header("WARC-Record-ID") or "").strip("<>")
    meta = {
        "url": url,
        "date": record.rec_headers.get_header("WARC-Date") or "",
        "charset": charset,
        "warc_file": name,
        "warc_offset": offset,
    }
    return {"id": record_id or f"{name}@{offset}", "text": text.strip(), "source": source, "meta": meta}, None


__all__ = ["read_warc", "decode_html", "is_warc", "check_extractor", "EXTRACTORS", "DEFAULT_EXTRACTOR"]
