import gzip
import json

import pytest

from kiln.data import corpus
from kiln.data.config import CorpusConfig
from kiln.data.corpus import build_corpus, choose_split_ids, iter_documents, split_document, stable_unit
from kiln.errors import ConfigError, DataError

COPYRIGHT = "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n" + "License: MIT\n" * 20


@pytest.fixture
def fake_debian(tmp_path, monkeypatch):
    """A /usr/share/doc look-alike with one file for each way a file can be kept or dropped."""
    root = tmp_path / "doc"
    files = {
        "alpha/copyright": COPYRIGHT.encode(),
        "alpha/changelog.Debian.gz": gzip.compress(
            ("alpha (1.0) unstable; urgency=low\n\n  * Initial.\n" * 10).encode()
        ),
        "alpha/style.css": b"body { color: red; }" * 20,  # not prose: never read
        "beta/README": "Caf\xe9 cr\xe8me, encoded as latin-1\n".encode("latin-1") * 10,
        "beta/changelog.gz": b"\x1f\x8b this is not really gzip",
        "beta/notes.txt": b"binary\x00data" * 20,
        "gamma/copyright": COPYRIGHT.encode(),  # identical to alpha's
        "gamma/NEWS": b"short",
        "delta/README.md": "".join(f"line {i} of a long readme with some words\n" for i in range(100)).encode(),
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "epsilon").symlink_to(root / "alpha")  # Debian links docs of related packages
    monkeypatch.setattr(corpus, "DEBIAN_DOC_ROOT", root)
    return root


def read_records(folder):
    return [json.loads(line) for p in sorted(folder.glob("docs-*.jsonl")) for line in p.read_text().splitlines()]


def test_split_document_cuts_at_line_breaks():
    text = "".join(f"line number {i}\n" for i in range(50))
    pieces = split_document(text, 100)
    assert "".join(pieces) == text
    assert all(len(p) <= 100 for p in pieces)
    assert all(p.endswith("\n") for p in pieces)
    long_line = "x" * 250
    assert split_document(long_line, 100) == ["x" * 100, "x" * 100, "x" * 50]
    assert split_document("short", 100) == ["short"]


def test_debian_files_are_kept_split_or_rejected_with_reasons(tmp_path, fake_debian):
    cfg = CorpusConfig(sources=["debian_docs"], min_chars=64, max_chars=1000)
    stats = build_corpus(cfg, tmp_path / "out")
    records = read_records(tmp_path / "out")
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids))
    by_path = {}
    for r in records:
        assert set(r) == {"id", "text", "source", "meta"} and r["source"] == "debian_docs"
        assert len(r["text"]) >= 64 and len(r["text"]) <= 1000
        by_path.setdefault(r["meta"]["path"], []).append(r)
    kept = {p.split("/doc/")[1] for p in by_path}
    # gamma/copyright duplicates alpha/copyright: exactly one of the two survives.
    assert kept - {"alpha/copyright", "gamma/copyright"} == {"alpha/changelog.Debian.gz", "delta/README.md"}
    assert len(kept & {"alpha/copyright", "gamma/copyright"}) == 1
    readme = by_path[str(fake_debian / "delta/README.md")]
    assert len(readme) == 5 and "".join(r["text"] for r in readme) == (fake_debian / "delta/README.md").read_text()
    assert [r["meta"]["part"] for r in readme] == list(range(5)) and readme[0]["meta"]["package"] == "delta"
    assert "alpha (1.0)" in by_path[str(fake_debian / "alpha/changelog.Debian.gz")][0]["text"]

    source = stats["sources"]["debian_docs"]
    assert source["dropped"] == {
        "not UTF-8": 1,
        "bad gzip": 1,
        "binary": 1,
        "exact duplicate": 1,
        "shorter than min_chars": 1,
    }
    rejected = [json.loads(line) for line in (tmp_path / "out/rejected/rejected.jsonl").read_text().splitlines()]
    reasons = {r["path"].split("/doc/")[1]: r["reason"] for r in rejected}
    assert reasons["beta/README"].startswith("not UTF-8")
    assert reasons["beta/changelog.gz"].startswith("bad gzip")
    assert reasons["gamma/NEWS"] == "shorter than min_chars=64"
    assert all(r["step"] == "corpus" for r in rejected)
    assert stats["documents"] == len(records) == source["documents"]
    assert json.loads((tmp_path / "out/stats.json").read_text()) == stats


def test_cap_is_respected_and_selection_is_seeded(tmp_path, fake_debian):
    for i in range(30):
        (fake_debian / f"pkg{i:02d}").mkdir()
        (fake_debian / f"pkg{i:02d}" / "README").write_text(f"package {i} readme text\n" * 10)
    cfg = CorpusConfig(sources=["debian_docs"], max_bytes_per_source=2000, seed=0)
    stats = build_corpus(cfg, tmp_path / "a")
    assert 2000 - cfg.min_chars <= stats["bytes"] <= 2000
    assert sum(len(r["text"].encode()) for r in read_records(tmp_path / "a")) == stats["bytes"]
    build_corpus(cfg, tmp_path / "b")
    assert (tmp_path / "a/docs-00000.jsonl").read_bytes() == (tmp_path / "b/docs-00000.jsonl").read_bytes()
    cfg.seed = 1
    build_corpus(cfg, tmp_path / "c")
    assert {r["id"] for r in read_records(tmp_path / "a")} != {r["id"] for r in read_records(tmp_path / "c")}


def test_missing_debian_docs_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "DEBIAN_DOC_ROOT", tmp_path / "absent")
    cfg = CorpusConfig(sources=["python_docs", "debian_docs"], max_bytes_per_source=20_000)
    stats = build_corpus(cfg, tmp_path / "out")
    assert stats["sources"]["debian_docs"]["documents"] == 0
    assert "no files found" in stats["sources"]["debian_docs"]["note"]
    assert stats["sources"]["python_docs"]["documents"] > 0
    with pytest.raises(DataError, match="no documents"):
        build_corpus(CorpusConfig(sources=["debian_docs"]), tmp_path / "none")


def test_python_sources_are_real_and_skip_test_suites(tmp_path):
    cfg = CorpusConfig(sources=["python_stdlib", "python_docs"], max_bytes_per_source=60_000)
    stats = build_corpus(cfg, tmp_path / "out")
    records = read_records(tmp_path / "out")
    for name in cfg.sources:
        assert 0 < stats["sources"][name]["bytes"] <= 60_000
    stdlib = [r for r in records if r["source"] == "python_stdlib"]
    assert all(r["meta"]["path"].endswith(".py") and r["meta"]["license"] == "PSF-2.0" for r in stdlib)
    assert not any("/test/" in r["meta"]["path"] or "site-packages" in r["meta"]["path"] for r in stdlib)
    assert any(("def " in r["text"] or "class " in r["text"]) for r in stdlib)
    kinds = {r["meta"]["kind"] for r in records if r["source"] == "python_docs"}
    assert kinds <= {"reference_topic", "docstrings", "prose"} and len(kinds) >= 2
    assert [r["id"] for r in iter_documents(tmp_path / "out")] == [r["id"] for r in records]


def test_module_docstrings_are_read_without_importing(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""Module doc."""\nraise SystemExit("imported!")\n'
        'class Thing:\n    """A thing."""\n    def go(self, n=1):\n        """Go n times."""\n'
        'def _private():\n    """hidden"""\n'
    )
    text = corpus.module_docstrings(module, "m")
    assert "Module m\n\nModule doc." in text and "class m.Thing\nA thing." in text
    assert "m.Thing.go(self, n=1)\nGo n times." in text and "hidden" not in text


def test_stable_unit_and_split_ids(tmp_path):
    assert stable_unit("python_stdlib/os.py#0") == stable_unit("python_stdlib/os.py#0")
    values = [stable_unit(f"doc{i}") for i in range(2000)]
    assert all(0 <= v < 1 for v in values) and 0.4 < sum(values) / len(values) < 0.6
    folder = tmp_path / "c"
    folder.mkdir()
    docs = [{"id": f"s/{i}", "text": "t", "source": "s"} for i in range(3)] + [
        {"id": "lone", "text": "t", "source": "z"}
    ]
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    chosen = choose_split_ids(folder, 1e-9)
    assert chosen == {min((d["id"] for d in docs[:3]), key=stable_unit)}  # lone source has < 2 docs


def test_bad_input_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown source 'web'"):
        build_corpus(CorpusConfig(sources=["web"]), tmp_path / "x")
    with pytest.raises(DataError, match="no \\*.jsonl"):
        list(iter_documents(tmp_path / "missing"))
    (tmp_path / "docs-00000.jsonl").write_text('{"id": "a", "text": "b", "source": "c"}\n{oops\n')
    with pytest.raises(DataError, match="docs-00000.jsonl:2: not JSON"):
        list(iter_documents(tmp_path))
    (tmp_path / "docs-00000.jsonl").write_text('{"id": "a", "text": 5, "source": "c"}\n')
    with pytest.raises(DataError, match="docs-00000.jsonl:1: field 'text'"):
        list(iter_documents(tmp_path))
    (tmp_path / "docs-00000.jsonl").write_bytes(b'{"id": "a", "text": "b", "source": "c"}\n{"id": "\xff"}\n')
    with pytest.raises(DataError, match="docs-00000.jsonl:2: not UTF-8 text"):
        list(iter_documents(tmp_path))
