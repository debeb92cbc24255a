"""WARC input on a real crawl built at test time from Debian's HTML documentation (kiln.data.warc_demo)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from kiln_testing.s3 import KEYS

from kiln import storage
from kiln.data import warc_demo
from kiln.data.config import CurateConfig
from kiln.data.curate import curate
from kiln.data.readers import read_documents
from kiln.data.steps import build_step
from kiln.data.warc import read_warc
from kiln.errors import ConfigError
from kiln.model.weights import load_weights

pytest.importorskip("warcio", reason="WARC input needs warcio (pip install 'kiln[data]')")
pytest.importorskip("resiliparse", reason="the default HTML extractor is resiliparse (pip install 'kiln[data]')")
pytest.importorskip("charset_normalizer", reason="charset detection needs charset-normalizer")

from warcio.archiveiterator import ArchiveIterator  # noqa: E402
from warcio.statusandheaders import StatusAndHeaders  # noqa: E402
from warcio.warcwriter import WARCWriter  # noqa: E402

needs_debian_html = pytest.mark.skipif(
    not (warc_demo.PYTHON_HTML.is_dir() and warc_demo.DEBIAN_FAQ.is_dir() and warc_demo.DEBIAN_REFERENCE.is_dir()),
    reason=f"the demo crawl needs Debian's HTML docs: apt-get install {warc_demo.PACKAGES}",
)
PYTHON_PAGES = 6
CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.fixture(scope="module")
def crawl(tmp_path_factory) -> Path:
    if not (warc_demo.PYTHON_HTML.is_dir() and warc_demo.DEBIAN_FAQ.is_dir() and warc_demo.DEBIAN_REFERENCE.is_dir()):
        pytest.skip(f"the demo crawl needs Debian's HTML docs: apt-get install {warc_demo.PACKAGES}")
    path = tmp_path_factory.mktemp("crawl") / "crawl.warc.gz"
    warc_demo.build_demo_warc(path, python_pages=PYTHON_PAGES)
    return path


def _read(path, **kw):
    docs, rejected = [], []
    for doc, rejection in read_documents(path, **kw):
        (docs if doc else rejected).append(doc or rejection)
    return docs, rejected


def _offsets(path: Path) -> dict[str, int]:
    """URL -> byte offset of its response record, from warcio itself."""
    out = {}
    with open(path, "rb") as fh:
        records = ArchiveIterator(fh)
        for record in records:
            if record.rec_type == "response":
                out[record.rec_headers.get_header("WARC-Target-URI")] = records.get_record_offset()
    return out


@needs_debian_html
def test_demo_crawl_pages_meta_and_chinese(crawl):
    docs, rejected = _read(crawl)
    faq = sorted(warc_demo.DEBIAN_FAQ.glob("*.html"))
    reference = sorted(warc_demo.DEBIAN_REFERENCE.glob("*.zh-cn.html"))
    assert len(docs) == PYTHON_PAGES + len(faq) + len(reference)
    assert Counter(r["reason"] for r in rejected) == {"not_html": 2}  # the two text/plain reST sources
    offsets = _offsets(crawl)
    for doc in docs:
        assert doc["source"] == "crawl"
        assert doc["meta"]["warc_offset"] == offsets[doc["meta"]["url"]]
    by_url = {d["meta"]["url"]: d for d in docs}
    first = faq[0]
    doc = by_url[f"https://www.debian.org/doc/manuals/debian-faq/{first.name}"]
    assert doc["meta"]["date"] == warc_demo._date(first)
    assert doc["meta"]["charset"] == "utf-8"  # the HTTP header names none: found in the page's <meta>
    # The Chinese survives decoding and extraction, including the pages re-encoded as GB18030.
    gb = [by_url[f"https://www.debian.org/doc/manuals/debian-faq/{p.name}"] for p in faq[1:3]]
    assert [d["meta"]["charset"] for d in gb] == ["gb18030", "gb18030"]
    for page, d in zip(faq[1:3], gb):
        title = re.search(r"<title>(.*?)</title>", page.read_text(encoding="utf-8")).group(1)
        assert CJK.search(title) and title in d["text"]
    zh = [d for d in docs if "debian.org" in d["meta"]["url"]]
    assert all(len(CJK.findall(d["text"])) > 100 for d in zh)
    assert "Python" in by_url[next(u for u in by_url if "docs.python.org" in u)]["text"]


def _corrupt(src: Path, dst: Path, offset: int) -> None:
    data = bytearray(src.read_bytes())
    # Damage the deflate stream inside the member, past its 10-byte gzip header.
    for i in range(offset + 40, offset + 60):
        data[i] ^= 0x5A
    dst.write_bytes(bytes(data))


@needs_debian_html
def test_corrupt_member_quarantined_with_file_and_offset(crawl, tmp_path):
    offsets = _offsets(crawl)
    victim_url = sorted(offsets, key=offsets.get)[3]
    bad = tmp_path / "bad.warc.gz"
    _corrupt(crawl, bad, offsets[victim_url])
    docs, rejected = _read(bad)
    good, _ = _read(crawl)
    corrupt = [r for r in rejected if r["reason"] == "corrupt_record"]
    assert len(corrupt) == 1
    assert corrupt[0]["file"] == str(bad) and corrupt[0]["offset"] == offsets[victim_url]
    # Only the damaged record is lost: the read resumed at the next gzip member.
    assert sorted(d["meta"]["url"] for d in docs) == sorted(
        d["meta"]["url"] for d in good if d["meta"]["url"] != victim_url
    )
    # Through the curation stage, the quarantine line names the file and the offset.
    cfg = CurateConfig(inputs=[str(bad)], steps=["normalize"], tasks=1, workers=1)
    stats = curate(cfg, tmp_path / "out", log=lambda *_: None)
    assert stats["steps"][0]["reasons"]["corrupt_record"] == 1
    lines = [json.loads(x) for f in (tmp_path / "out" / "rejected").glob("*.jsonl") for x in f.read_text().splitlines()]
    [line] = [x for x in lines if x["reason"] == "corrupt_record"]
    assert line["step"] == "read" and line["file"] == str(bad) and line["offset"] == offsets[victim_url]


def _small_warc(path: Path, pages: list[tuple[str, bytes, str]]) -> dict[str, int]:
    with open(path, "wb") as fh:
        writer = WARCWriter(fh, gzip=path.name.endswith(".gz"))
        for url, body, content_type in pages:
            http = StatusAndHeaders("200 OK", [("Content-Type", content_type)], protocol="HTTP/1.1")
            writer.write_record(writer.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=http))
    return _offsets(path)


def test_unparseable_records_are_counted_with_reasons(tmp_path):
    page = (
        b"<html><head><title>t</title></head><body><p>" + b"A sentence of real text here. " * 20 + b"</p></body></html>"
    )
    path = tmp_path / "mixed.warc"
    offsets = _small_warc(
        path,
        [
            ("https://a.example/ok", page, "text/html; charset=no-such-charset"),  # bad declaration: passed over
            ("https://a.example/empty", b"<html><body><script>x()</script></body></html>", "text/html"),
            ("https://a.example/logo.png", b"\x89PNG\r\n", "image/png"),
        ],
    )
    docs, rejected = _read(path)
    assert [d["meta"]["url"] for d in docs] == ["https://a.example/ok"]
    assert [(r["reason"], r["offset"]) for r in rejected] == [
        ("extraction_empty", offsets["https://a.example/empty"]),
        ("not_html", offsets["https://a.example/logo.png"]),
    ]
    # An uncompressed WARC with damaged headers resumes at the next WARC/1.x line.
    data = b"XARC" + path.read_bytes()[4:]  # the first record's version line
    (tmp_path / "bad.warc").write_bytes(data)
    docs, rejected = _read(tmp_path / "bad.warc")
    assert docs == [] and [r["reason"] for r in rejected] == ["corrupt_record", "extraction_empty", "not_html"]
    assert rejected[0]["offset"] == 0 and rejected[1]["offset"] == offsets["https://a.example/empty"]


@needs_debian_html
def test_url_filter_counts_per_reason(crawl, tmp_path):
    params = {
        "url_filter": {
            "block_domains": ["debian.org"],  # blocks www.debian.org, the Chinese pages
            "block_words": ["fractions"],  # library/fractions.html; not a word of any other URL
            "block_substrings": ["robot"],  # library/urllib.robotparser.html, inside a word
        }
    }
    cfg = CurateConfig(inputs=[str(crawl)], steps=["url_filter"], params=params, tasks=1, workers=1)
    cfg.validate()
    stats = curate(cfg, tmp_path / "out", log=lambda *_: None)
    docs, _ = _read(crawl)
    debian = sum("www.debian.org" in d["meta"]["url"] for d in docs)
    assert debian == len(list(warc_demo.DEBIAN_FAQ.glob("*.html"))) + len(
        list(warc_demo.DEBIAN_REFERENCE.glob("*.zh-cn.html"))
    )
    row = stats["steps"][1]
    assert row["name"] == "url_filter"
    assert row["reasons"] == {"blocked_domain": debian, "blocked_url_word": 1, "blocked_url_substring": 1}
    assert row["docs_out"] == len(docs) - debian - 2
    kept = {
        json.loads(x)["meta"]["url"] for x in (tmp_path / "out" / "docs" / "part-00000.jsonl").read_text().splitlines()
    }
    assert not any("fractions" in u or "robot" in u or "debian" in u for u in kept)


def test_url_filter_rules(tmp_path):
    (tmp_path / "domains.txt").write_text("# adult\nbad.example\n", encoding="utf-8")
    step = build_step("url_filter", {"domain_files": [str(tmp_path / "domains.txt")], "block_words": ["sex"]}, "p")
    step.setup()

    def why(url):
        return step.reason({"text": "t", "meta": {"url": url} if url else {}})

    assert why("https://www.bad.example/x") == "blocked_domain"
    assert why("https://a.b.bad.example/x") == "blocked_domain"
    assert why("https://notbad.example/x") is None
    assert why("https://shop.example/sex-toys") == "blocked_url_word"
    assert why("https://essex.example/sussex") is None
    assert why(None) is None and step.stats.counters["no_url"] == 1
    with pytest.raises(ConfigError, match="p.domain_files"):
        build_step("url_filter", {"domain_files": [str(tmp_path / "missing.txt")]}, "p")


def test_demo_crawl_is_built_once_where_the_input_names(tmp_path):
    if not (warc_demo.PYTHON_HTML.is_dir() and warc_demo.DEBIAN_FAQ.is_dir() and warc_demo.DEBIAN_REFERENCE.is_dir()):
        pytest.skip(f"the demo crawl needs Debian's HTML docs: apt-get install {warc_demo.PACKAGES}")
    path = tmp_path / "crawl" / "demo.warc.gz"
    assert warc_demo.ensure_demo_crawl(path, python_pages=2) and path.is_file()
    built = path.read_bytes()
    assert not warc_demo.ensure_demo_crawl(path, python_pages=2) and path.read_bytes() == built  # kept


@pytest.mark.parametrize(
    "inputs", [[], ["a.warc.gz", "b.warc.gz"], ["docs.jsonl"], ["s3://bucket/a.warc.gz"], [{"path": "a.warc.gz"}]]
)
def test_demo_crawl_needs_one_local_warc_input(inputs):
    with pytest.raises(ConfigError) as err:
        CurateConfig(inputs=inputs, demo_crawl=True).validate()
    assert err.value.key == "demo_crawl"
    CurateConfig(inputs=["crawl/x.warc.gz"], demo_crawl=True).validate()


def test_extractor_selection_reaches_the_reader(tmp_path):
    pytest.importorskip("trafilatura", reason="the other extractor is trafilatura (pip install 'kiln[data]')")
    # A page whose boilerplate the two extractors treat differently: a navigation list and a footer.
    body = (
        "<html><head><meta charset='utf-8'><title>Kiln</title></head><body>"
        "<nav><ul><li><a href='/'>Home</a></li><li><a href='/docs'>Docs</a></li></ul></nav>"
        "<article><h1>Curating crawls</h1>"
        + "".join(f"<p>Paragraph {i} explains how a web crawl becomes training text for a model.</p>" for i in range(8))
        + "</article><footer>Copyright 2026 Example Inc. All rights reserved.</footer></body></html>"
    ).encode()
    path = tmp_path / "one.warc.gz"
    _small_warc(path, [("https://kiln.example/crawl", body, "text/html")])
    texts = {}
    for name in ("trafilatura", "resiliparse"):
        cfg = CurateConfig(inputs=[str(path)], steps=["normalize"], tasks=1, workers=1, html_extractor=name)
        curate(cfg, tmp_path / name, log=lambda *_: None)
        [line] = (tmp_path / name / "docs" / "part-00000.jsonl").read_text().splitlines()
        texts[name] = json.loads(line)["text"]
        [(direct, _)] = list(read_warc(path, "one", "one.warc.gz", name))
        assert texts[name] == direct["text"]
    assert texts["trafilatura"] != texts["resiliparse"]
    with pytest.raises(ConfigError, match="html_extractor"):
        CurateConfig(html_extractor="justext").validate()


@pytest.mark.slow
@needs_debian_html
def test_crawl_demo_recipe_end_to_end(tmp_path):
    """The crawl demo as documented, from a clean clone: `kiln run recipes/crawl-demo.toml` with no
    crawl on disk yet, which its data stage builds (data.demo_crawl)."""
    warc = tmp_path / "crawl" / "debian-html.warc.gz"
    cmd = [sys.executable, "-m", "kiln.cli", "run", "recipes/crawl-demo.toml", f'run.out_dir="{tmp_path}"']
    # 30 of the recipe's 100 steps: the chain is under test here, not how far the loss falls.
    short = ["train.max_steps=30", "train.warmup_steps=3", "train.eval_every=15", "train.ckpt_every=30"]
    result = subprocess.run([*cmd, f'data.inputs=["{warc}"]', *short], capture_output=True, text=True, check=True)
    run_dir = tmp_path / "crawl-demo"
    assert warc.is_file() and "building the demo crawl" in result.stdout
    for stage in ("data", "tokenizer", "pack", "pretrain", "sample"):
        assert (run_dir / stage / "DONE").exists()
    stats = json.loads((run_dir / "data" / "stats.json").read_text())
    rows = {row["name"]: row for row in stats["steps"]}
    assert rows["read"]["reasons"] == {"not_html": 2}
    assert rows["url_filter"]["reasons"]["blocked_url_word"] > 0
    assert "url_filter" in result.stdout  # the funnel was printed
    docs = [json.loads(x) for f in (run_dir / "data" / "docs").glob("*.jsonl") for x in f.read_text().splitlines()]
    assert {d["meta"]["lang"] for d in docs} >= {"en", "zh"}  # Chinese pages reach the tokenizer
    evals = [json.loads(line) for line in (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in evals if r["kind"] == "val"]
    assert len(val) >= 2 and val[-1] < val[0], val


@pytest.mark.slow
@needs_debian_html
def test_crawl_demo_recipe_on_s3(tmp_path, s3_bucket, s3_server):
    """The same recipe with s3:// paths: the crawl read from the store and every stage folder
    published there; a second `kiln run` finds everything done."""
    warc = tmp_path / "debian-html.warc.gz"
    subprocess.run([sys.executable, "-m", "kiln.data.warc_demo", str(warc)], check=True, capture_output=True)
    storage.upload(warc, f"{s3_bucket}/crawl/debian-html.warc.gz")
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": KEYS["key"],
        "AWS_SECRET_ACCESS_KEY": KEYS["secret"],
        "AWS_DEFAULT_REGION": "eu-west-1",
        "KILN_CACHE": str(tmp_path / "cache"),
    }
    cmd = [
        sys.executable,
        "-m",
        "kiln.cli",
        "run",
        "recipes/crawl-demo.toml",
        f'run.out_dir="{s3_bucket}/runs"',
        f'data.inputs=["{s3_bucket}/crawl/debian-html.warc.gz"]',
        "data.demo_crawl=false",  # the crawl is already on the store
        f'storage.s3.endpoint_url="{s3_server}"',
        # A short chain: the storage is under test here, not how far the loss falls.
        "tokenizer.vocab_size=1024",
        "train.max_steps=6",
        "train.warmup_steps=2",
        "train.eval_every=3",
        "train.ckpt_every=3",
        "sample.max_new_tokens=8",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    run = f"{s3_bucket}/runs/crawl-demo"
    stages = ("data", "tokenizer", "pack", "pretrain", "sample")
    for stage in stages:
        assert storage.isfile(f"{run}/{stage}/DONE"), stage
    rows = {row["name"]: row for row in json.loads(storage.read_text(f"{run}/data/stats.json"))["steps"]}
    assert rows["read"]["reasons"] == {"not_html": 2}
    assert storage.isfile(f"{run}/pretrain/checkpoints/step-00000006/manifest.json")
    # The stage folder loads its best checkpoint (step 3 or 6, whichever validated lower).
    best = json.loads(storage.read_text(f"{run}/pretrain/summary.json"))["best_step"]
    _, weights, manifest = load_weights(f"{run}/pretrain")
    assert best in (3, 6) and manifest["step"] == best and weights["tok_embeddings.weight"].shape[0] == 1024
    assert load_weights(f"{run}/pretrain/checkpoints/step-00000006")[2]["step"] == 6
    assert "--- sample 0" in storage.read_text(f"{run}/sample/samples.txt")
    second = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    for stage in stages:
        assert f"[{stage}] done already in {run}/{stage}, skipping" in second.stdout
    assert "finished in" not in second.stdout
