import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from kiln.data.readers import RAW_CHARS, file_stem, input_format, list_inputs, read_documents, read_inputs
from kiln.errors import DataError


def split(records):
    docs = [d for d, r in records if d is not None]
    rejected = [r for d, r in records if r is not None]
    for d, r in records:
        assert (d is None) != (r is None)
    return docs, rejected


MIXED_LINES = [
    json.dumps({"id": "a", "text": "first document", "source": "web", "meta": {"k": 1}}).encode(),
    b"",  # blank: skipped, not a record
    json.dumps({"text": "no id, no source", "url": "http://x"}).encode(),
    b'{"text": "truncated',
    "not utf8 \xff".encode("latin-1"),
    json.dumps({"id": "b"}).encode(),
    json.dumps({"id": "c", "text": "   \n"}).encode(),
    json.dumps({"id": "d", "text": 42}).encode(),
    json.dumps([1, 2]).encode(),
    b'{"id": "e", "text": "lone \\ud800 surrogate"}',
    json.dumps({"id": 7, "text": "integer id"}).encode(),
    json.dumps({"id": "f", "text": "x", "meta": "notadict"}).encode(),
    json.dumps({"id": "g", "text": "emoji \ud83d\ude00 pair is fine", "meta": None}).encode(),
]
EXPECTED_REASONS = {
    2: None,
    4: "bad_json",
    5: "bad_utf8",
    6: "missing_text",
    7: "empty_text",
    8: "text_not_string",
    9: "not_an_object",
    10: "bad_utf8",
    12: "bad_meta",
}


def check_mixed(records, path: Path, name: str):
    docs, rejected = split(records)
    assert [d["id"] for d in docs] == ["a", f"{name}:3", "7", "g"]
    assert docs[0] == {"id": "a", "text": "first document", "source": "web", "meta": {"k": 1}}
    # Missing source falls back to the file stem; extra fields move into meta.
    assert docs[1]["source"] == "mixed" and docs[1]["meta"] == {"url": "http://x"}
    assert docs[3]["text"] == "emoji \U0001f600 pair is fine" and docs[3]["meta"] == {}
    got = {r["line"]: r["reason"] for r in rejected}
    assert got == {k: v for k, v in EXPECTED_REASONS.items() if v}
    assert all(r["file"] == str(path) for r in rejected)
    assert Counter(r["reason"] for r in rejected) == Counter(
        {
            "bad_json": 1,
            "bad_utf8": 2,
            "missing_text": 1,
            "empty_text": 1,
            "text_not_string": 1,
            "not_an_object": 1,
            "bad_meta": 1,
        }
    )


def test_jsonl_plain_gz_zst_agree(tmp_path):
    payload = b"\n".join(MIXED_LINES) + b"\n"
    (tmp_path / "plain").mkdir()
    plain = tmp_path / "plain" / "mixed.jsonl"
    plain.write_bytes(payload)
    gz = tmp_path / "mixed.jsonl.gz"
    gz.write_bytes(gzip.compress(payload))
    zstandard = pytest.importorskip("zstandard")
    zst = tmp_path / "mixed.jsonl.zst"
    # Two frames: files appended to (or written by pzstd) hold several.
    cctx = zstandard.ZstdCompressor()
    half = len(payload) // 2
    zst.write_bytes(cctx.compress(payload[:half]) + cctx.compress(payload[half:]))
    for path in (plain, gz, zst):
        check_mixed(list(read_documents(path)), path, path.name)


def test_source_argument_and_stable_ids(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "hello"}\n{"text": "again", "source": "own"}\n')
    docs, _ = split(list(read_documents(path, source="books")))
    assert [(d["id"], d["source"]) for d in docs] == [("x.jsonl:1", "books"), ("x.jsonl:2", "own")]
    # Ids do not depend on the absolute path: a folder listing names files relative to the folder.
    docs, _ = split(list(read_inputs([tmp_path])))
    assert [d["id"] for d in docs] == [f"{tmp_path.name}/x.jsonl:1", f"{tmp_path.name}/x.jsonl:2"]


def test_corrupt_gzip_rejected_and_read_continues(tmp_path):
    good = "".join(json.dumps({"text": f"document {i * 7919 % 10007}"}) + "\n" for i in range(4000))
    packed = gzip.compress(good.encode())
    broken = tmp_path / "a.jsonl.gz"
    broken.write_bytes(packed[: len(packed) // 2])  # a download cut off halfway
    other = tmp_path / "b.jsonl"
    other.write_text('{"text": "after"}\n')
    docs, rejected = split(list(read_inputs([broken, other])))
    assert len(rejected) == 1 and rejected[0]["reason"] == "corrupt_file"
    assert rejected[0]["file"] == str(broken) and rejected[0]["line"] > 1
    assert docs[-1]["text"] == "after"
    assert len(docs) == rejected[0]["line"] - 1 + 1  # every line before the damage, plus b.jsonl


def test_raw_is_truncated(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text('{"text": "' + "x" * 5000 + "\n")
    _, rejected = split(list(read_documents(path)))
    assert rejected[0]["reason"] == "bad_json"
    assert len(rejected[0]["raw"]) == RAW_CHARS + 3


def test_text_folder(tmp_path):
    root = tmp_path / "notes"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("second file\n")
    (root / "a.md").write_text("\ufeff# first\n")
    (root / "sub" / "c.txt").write_bytes(b"line one\nline two \xff\n")
    (root / "empty.txt").write_text("  \n")
    (root / ".hidden.txt").write_text("editor litter")
    (root / "skip.bin").write_bytes(b"\x00")
    files = list_inputs(root)
    assert [p.relative_to(root).as_posix() for p in files] == ["a.md", "b.txt", "empty.txt", "sub/c.txt"]
    docs, rejected = split(list(read_inputs(root)))
    assert [(d["id"], d["source"], d["text"]) for d in docs] == [
        ("notes/a.md", "notes", "# first\n"),
        ("notes/b.txt", "notes", "second file\n"),
    ]
    assert [(Path(r["file"]).name, r["line"], r["reason"]) for r in rejected] == [
        ("empty.txt", 1, "empty_text"),
        ("c.txt", 2, "bad_utf8"),
    ]


def test_list_inputs_globs_and_errors(tmp_path):
    for name in ["b.jsonl", "a.jsonl.gz", "c.parquet", "d.csv"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in list_inputs(str(tmp_path / "*"))] == ["a.jsonl.gz", "b.jsonl", "c.parquet"]
    # Entries keep their order; a file listed twice is read once.
    got = list_inputs([tmp_path / "b.jsonl", str(tmp_path / "*.jsonl*")])
    assert [p.name for p in got] == ["b.jsonl", "a.jsonl.gz"]
    with pytest.raises(DataError, match="no such file"):
        list_inputs(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="unknown input format"):
        list_inputs(tmp_path / "d.csv")
    with pytest.raises(DataError, match="matches no"):
        list_inputs(str(tmp_path / "*.xml"))


def test_format_and_stem():
    assert input_format(Path("a.JSONL.ZST")) == "jsonl"
    assert input_format(Path("a.ndjson.gz")) == "jsonl"
    assert input_format(Path("a.txt.gz")) is None
    assert input_format(Path("a.parquet")) == "parquet"
    assert file_stem(Path("web-00.jsonl.zst")) == "web-00"
    assert file_stem(Path("notes.txt")) == "notes"


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "id": ["p1", None, "p3", "p4"],
            "text": ["parquet text", "second row", None, ""],
            "meta": ['{"lang": "en"}', None, None, None],
            "url": ["u1", "u2", "u3", "u4"],
        }
    )
    path = tmp_path / "shard.parquet"
    pq.write_table(table, path, row_group_size=2)
    docs, rejected = split(list(read_documents(path)))
    assert docs == [
        {"id": "p1", "text": "parquet text", "source": "shard", "meta": {"lang": "en", "url": "u1"}},
        {"id": "shard.parquet:2", "text": "second row", "source": "shard", "meta": {"url": "u2"}},
    ]
    assert [(r["line"], r["reason"]) for r in rejected] == [(3, "missing_text"), (4, "empty_text")]

    no_text = tmp_path / "notext.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_text)
    _, rejected = split(list(read_documents(no_text)))
    assert [(r["line"], r["reason"]) for r in rejected] == [(0, "missing_text")]

    broken = tmp_path / "broken.parquet"
    broken.write_bytes(path.read_bytes()[:-40])
    docs, rejected = split(list(read_documents(broken)))
    assert docs == [] and [r["reason"] for r in rejected] == ["corrupt_file"]


def test_real_text_round_trip(tmp_path):
    # Real documentation text nobody here wrote, through every container format.
    from pydoc_data.topics import topics

    records = [{"id": k, "text": v} for k, v in sorted(topics.items())[:40]]
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    gz = tmp_path / "topics.jsonl.gz"
    gz.write_bytes(gzip.compress(payload))
    docs, rejected = split(list(read_documents(gz)))
    assert rejected == []
    assert [(d["id"], d["text"], d["source"]) for d in docs] == [(r["id"], r["text"], "topics") for r in records]


def test_iter_jsonl_classifies_every_line_and_keeps_numbers(tmp_path):
    import gzip

    from kiln.data.readers import iter_jsonl

    lines = [b'{"a": 1}', b"", b"[1, 2]", b"{not json", b'{"b": "\xff"}', b"   ", b'{"c": [' + b"[" * 5000 + b"]"]
    for name, write in (
        ("x.jsonl", lambda p, d: p.write_bytes(d)),
        ("x.jsonl.gz", lambda p, d: p.write_bytes(gzip.compress(d))),
    ):
        path = tmp_path / name
        write(path, b"\n".join(lines) + b"\n")
        got = [(line.number, line.problem, line.record) for line in iter_jsonl(path)]
        assert got == [
            (1, None, {"a": 1}),
            (3, "not_an_object", None),
            (4, "bad_json", None),
            (5, "bad_utf8", None),
            (7, "bad_json", None),
        ]
    replaced = list(iter_jsonl(tmp_path / "x.jsonl", decode_errors="replace"))
    assert replaced[3].record == {"b": "\ufffd"} and replaced[3].problem is None
    assert [line.why for line in replaced[:3]] == ["", "not a JSON object", replaced[2].why]
    assert replaced[2].why.startswith("not JSON (")


def test_a_lone_surrogate_in_any_field_is_quarantined(tmp_path):
    """A lone surrogate in the id or the meta breaks the UTF-8 writer as surely as one in the text:
    each such line is a bad_utf8 rejection with its file and line, and the read goes on."""
    path = tmp_path / "s.jsonl"
    path.write_bytes(
        b'{"id": "\\ud800", "text": "lone surrogate in the id"}\n'
        b'{"text": "in the meta", "meta": {"title": "x\\udfff"}}\n'
        b'{"text": "in an extra field", "url": "\\udbff"}\n'
        b'{"text": "a literal backslash: \\\\ud800 is six characters"}\n'
    )
    docs, rejected = split(list(read_documents(path)))
    assert [(r["file"], r["line"], r["reason"]) for r in rejected] == [(str(path), n, "bad_utf8") for n in (1, 2, 3)]
    assert [d["text"] for d in docs] == ["a literal backslash: \\ud800 is six characters"]


def test_a_parquet_row_that_is_not_utf8_costs_that_row(tmp_path):
    """Arrow does not validate strings other writers stored: the bad row is a bad_utf8 rejection with
    its row number, and the rows around it (same batch, same file) are read."""
    pytest.importorskip("pyarrow")
    from kiln_testing.text import write_parquet_with_bad_utf8

    path = tmp_path / "t.parquet"
    write_parquet_with_bad_utf8(path, {"id": ["a", "b", "c"], "text": ["one", "two", "three"]}, "text", 1)
    docs, rejected = split(list(read_documents(path)))
    assert [d["id"] for d in docs] == ["a", "c"]
    assert [(r["file"], r["line"], r["reason"]) for r in rejected] == [(str(path), 2, "bad_utf8")]
