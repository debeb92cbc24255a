"""Property tests of the data readers: any bytes in a JSONL (plain, .gz, .zst), text or Parquet
file give documents and rejections with a known reason, one per record, in file order; never an
exception and never a hang. Damaged compressed or Parquet files end in one corrupt_file rejection."""

import gzip
import io
import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kiln_testing.fuzz import fuzz_examples, fuzz_settings, no_hang  # noqa: E402

from kiln.data.readers import RAW_CHARS, has_lone_surrogate, read_documents  # noqa: E402

EXAMPLES = fuzz_examples(100)
FUZZ = fuzz_settings(EXAMPLES, [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
HEAVY = settings(FUZZ, max_examples=EXAMPLES * 10)
REASONS = {
    "bad_utf8",
    "bad_json",
    "not_an_object",
    "missing_text",
    "text_not_string",
    "empty_text",
    "bad_id",
    "bad_source",
    "bad_meta",
    "corrupt_file",
}


def read_all(path, **kwargs) -> tuple[list[dict], list[dict]]:
    """Every record of one file, checking the reader's contract on each."""
    docs, rejected = [], []
    with no_hang():
        records = list(read_documents(path, **kwargs))
    last_line = 0
    for doc, rej in records:
        assert (doc is None) != (rej is None)
        if doc is not None:
            assert set(doc) == {"id", "text", "source", "meta"}
            assert isinstance(doc["id"], str) and doc["id"]
            assert isinstance(doc["text"], str) and doc["text"].strip()
            assert not has_lone_surrogate(doc["text"])
            assert isinstance(doc["source"], str) and doc["source"]
            assert isinstance(doc["meta"], dict)
            docs.append(doc)
        else:
            assert set(rej) == {"file", "line", "reason", "raw"}
            assert rej["reason"] in REASONS, rej
            assert rej["file"] == str(path)
            assert isinstance(rej["line"], int) and rej["line"] >= last_line, (rej, last_line)
            last_line = rej["line"]
            assert isinstance(rej["raw"], str) and len(rej["raw"]) <= RAW_CHARS + 3
            json.dumps(rej, ensure_ascii=False).encode("utf-8")  # rejections are written out as JSONL
            rejected.append(rej)
    return docs, rejected


# ---- line strategies ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
records = st.fixed_dictionaries(
    {},
    optional={
        "text": st.text(max_size=40) | json_values,
        "id": st.text(max_size=8) | json_values,
        "source": st.text(max_size=8) | json_values,
        "meta": st.dictionaries(st.text(max_size=5), json_values) | json_values,
        "url": json_values,
    },
)
record_lines = records.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass"))
escaped_lines = records.map(lambda r: json.dumps(r).encode("ascii"))  # \ud800-style escapes
odd_lines = st.sampled_from(
    [
        b"",
        b"   ",
        b"\r",
        b"\x0b\x0c",
        b"{",
        b"}",
        b"[]",
        b"null",
        b"NaN",
        b'{"text": NaN}',
        b'{"text": "a"} x',
        b'{"text": "a", "text": 5}',
        b'\xef\xbb\xbf{"text": "bom"}',
        b'{"text": "\\ud800"}',
        b'{"text": "\\udfff\\ud800"}',
        b'{"text": "ok", "id": 1e999}',
        b'{"text": "ok", "id": -0}',
        b'{"text": "ok", "id": true}',
        b"[" * 3000 + b"]" * 3000,
        b'{"text": "x", "meta": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}",
        b'{"text": "x", "id": ' + b"9" * 4400 + b"}",
        b'{"text": "x", "id": 1e' + b"9" * 400 + b"}",
        b'{"text": "\xff"}',
        b'{"text": "\xed\xa0\x80"}',
        b"\x00" * 10,
        b'{"text":"tab\there"}',
    ]
)
lines = st.lists(record_lines | escaped_lines | odd_lines | st.binary(max_size=60), max_size=12)


def jsonl_bytes(parts: list[bytes]) -> bytes:
    return b"\n".join(parts) + b"\n"


def expected_records(data: bytes) -> int:
    """Records the reader must account for: every line that is not blank."""
    return sum(1 for raw in io.BytesIO(data) if raw.strip())


# ---- properties ----------------------------------------------------------------------------------


@FUZZ
@given(parts=lines)
@example(parts=[b"[" * 100_000 + b"]" * 100_000])
@example(parts=[b'{"text": "x", "id": ' + b"9" * 5000 + b"}"])
@example(parts=[b'{"text": "x", "meta": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"])
def test_jsonl_lines_become_documents_or_rejections(tmp_path, parts):
    data = jsonl_bytes(parts)
    path = tmp_path / "shard.jsonl"
    path.write_bytes(data)
    docs, rejected = read_all(path)
    # One result per non-blank line: nothing dropped silently, nothing counted twice.
    assert len(docs) + len(rejected) == expected_records(data)
    assert all(r["reason"] != "corrupt_file" for r in rejected)


@FUZZ
@given(data=st.binary(max_size=400))
def test_jsonl_arbitrary_bytes(tmp_path, data):
    path = tmp_path / "shard.ndjson"
    path.write_bytes(data)
    docs, rejected = read_all(path)
    assert len(docs) + len(rejected) == expected_records(data)


@FUZZ
@given(parts=lines, codec=st.sampled_from(["gz", "zst"]))
def test_compressed_jsonl_reads_as_plain(tmp_path, parts, codec):
    data = jsonl_bytes(parts)
    plain = tmp_path / "shard.jsonl"
    plain.write_bytes(data)
    packed = tmp_path / f"shard.jsonl.{codec}"
    packed.write_bytes(compress(data, codec))
    # The same name for both, so that default ids (name:line) agree.
    expected = read_all(plain, name="shard")
    docs, rejected = read_all(packed, name="shard")
    assert docs == expected[0]
    assert [(r["line"], r["reason"], r["raw"]) for r in rejected] == [
        (r["line"], r["reason"], r["raw"]) for r in expected[1]
    ]


def compress(data: bytes, codec: str) -> bytes:
    if codec == "gz":
        return gzip.compress(data, mtime=0)
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(data)


@FUZZ
@given(
    parts=lines,
    codec=st.sampled_from(["gz", "zst"]),
    cut=st.floats(0, 1),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)), max_size=3),
)
@example(parts=[b'{"text": "hello"}'] * 50, codec="gz", cut=1.0, flips=[(0.5, 0x55)])
@example(parts=[b'{"text": "hello"}'] * 50, codec="zst", cut=1.0, flips=[(0.5, 0x55)])
def test_damaged_compressed_files(tmp_path, parts, codec, cut, flips):
    """Truncated or bit-flipped streams: the records read before the damage, then at most one
    corrupt_file rejection, and the read ends."""
    packed = bytearray(compress(jsonl_bytes(parts), codec))
    packed = packed[: int(len(packed) * cut)]
    for where, mask in flips:
        if packed:
            packed[min(int(where * len(packed)), len(packed) - 1)] ^= mask
    path = tmp_path / f"shard.jsonl.{codec}"
    path.write_bytes(bytes(packed))
    _, rejected = read_all(path)
    corrupt = [r for r in rejected if r["reason"] == "corrupt_file"]
    assert len(corrupt) <= 1
    if corrupt:
        assert rejected[-1] is corrupt[0]  # nothing is read after the damage


@FUZZ
@given(data=st.binary(max_size=300) | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")))
@example(data=b"\xef\xbb\xbf")
@example(data=b"\xef\xbb\xbf  \n")
@example(data=b"ok \xed\xa0\x80")
def test_text_file_is_one_document_or_one_rejection(tmp_path, data):
    path = tmp_path / "notes" / "page.md"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    docs, rejected = read_all(path)
    assert len(docs) + len(rejected) == 1
    if docs:
        assert docs[0]["source"] == "notes" and docs[0]["id"] == "page.md"
    else:
        assert rejected[0]["reason"] in {"bad_utf8", "empty_text"}


# ---- Parquet --------------------------------------------------------------------------------------

columns = st.fixed_dictionaries(
    {},
    optional={
        "text": st.lists(st.none() | st.text(max_size=20), min_size=3, max_size=3)
        | st.lists(st.integers(-5, 5), min_size=3, max_size=3),
        "id": st.lists(st.none() | st.text(max_size=5), min_size=3, max_size=3)
        | st.lists(st.integers(-(2**63), 2**63 - 1), min_size=3, max_size=3),
        "source": st.lists(st.none() | st.text(max_size=5), min_size=3, max_size=3),
        "meta": st.lists(st.none() | st.text(max_size=20) | json_values.map(json.dumps), min_size=3, max_size=3),
        "url": st.lists(st.text(max_size=5), min_size=3, max_size=3),
        "score": st.lists(st.floats(), min_size=3, max_size=3),
    },
)


@FUZZ
@given(table=columns)
@example(table={"text": ["a", "b", "c"], "meta": ["[" * 50_000 + "]" * 50_000, "{}", "null"]})
@example(table={"text": ["a", "b", "c"], "meta": ['{"a": 1' + "0" * 5000 + "}", "{}", "{}"]})
def test_parquet_rows_become_documents_or_rejections(tmp_path, table):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "shard.parquet"
    pq.write_table(pa.table(table) if table else pa.table({"x": [1, 2, 3]}), path)
    docs, rejected = read_all(path)
    if "text" in table:
        assert len(docs) + len(rejected) == 3
        assert [r["line"] for r in rejected] == sorted({r["line"] for r in rejected})
    else:
        assert docs == [] and [r["reason"] for r in rejected] == ["missing_text"]


@FUZZ
@given(
    cut=st.floats(0, 1),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)), max_size=4),
    garbage=st.binary(max_size=64),
)
def test_damaged_parquet(tmp_path, cut, flips, garbage):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = io.BytesIO()
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(20)], "id": [str(i) for i in range(20)]}), good)
    data = bytearray(good.getvalue())
    data = data[: int(len(data) * cut)] + garbage if cut < 1 else data
    for where, mask in flips:
        if data:
            data[min(int(where * len(data)), len(data) - 1)] ^= mask
    path = tmp_path / "shard.parquet"
    path.write_bytes(bytes(data))
    _, rejected = read_all(path)
    assert sum(r["reason"] in {"corrupt_file", "missing_text"} for r in rejected) <= 1


@pytest.mark.slow
@HEAVY
@given(parts=lines, codec=st.sampled_from(["gz", "zst"]), cut=st.floats(0, 1))
def test_heavy_jsonl_and_damage(tmp_path, parts, codec, cut):
    data = jsonl_bytes(parts)
    path = tmp_path / "shard.jsonl"
    path.write_bytes(data)
    docs, rejected = read_all(path)
    assert len(docs) + len(rejected) == expected_records(data)
    packed = compress(data, codec)
    damaged = tmp_path / f"shard.jsonl.{codec}"
    damaged.write_bytes(packed[: int(len(packed) * cut)])
    read_all(damaged)


# ---- regressions the fuzzer found (each raised out of the reader) ------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        b"[" * 3000 + b"]" * 3000,  # RecursionError in json
        b'{"text": "x", "meta": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}",
        b'{"text": "x", "id": ' + b"9" * 5000 + b"}",  # ValueError: over 4300 digits
    ],
)
def test_pathological_json_lines_are_bad_json(tmp_path, line):
    path = tmp_path / "shard.jsonl"
    path.write_bytes(b'{"text": "before"}\n' + line + b'\n{"text": "after"}\n')
    docs, rejected = read_all(path)
    assert [d["text"] for d in docs] == ["before", "after"]
    assert [(r["line"], r["reason"]) for r in rejected] == [(2, "bad_json")]


def test_damaged_deflate_stream_is_corrupt_file(tmp_path):
    """A byte flipped inside the deflate data (header intact) raised zlib.error."""
    data = bytearray(gzip.compress(b"\n".join(b'{"text": "hello %d"}' % i for i in range(50)) + b"\n", mtime=0))
    data[len(data) // 2] ^= 0x55
    path = tmp_path / "shard.jsonl.gz"
    path.write_bytes(bytes(data))
    docs, rejected = read_all(path)
    assert docs == []
    assert [(r["line"], r["reason"]) for r in rejected] == [(1, "corrupt_file")]
    assert rejected[0]["raw"].startswith("zlib.error: ")


@pytest.mark.parametrize("meta", ["[" * 3000 + "]" * 3000, '{"a": 1' + "0" * 5000 + "}"])
def test_parquet_meta_string_that_breaks_json_is_bad_meta(tmp_path, meta):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "shard.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "meta": [meta, '{"k": 1}']}), path)
    docs, rejected = read_all(path)
    assert [(r["line"], r["reason"]) for r in rejected] == [(1, "bad_meta")]
    assert docs == [{"id": "shard.parquet:2", "text": "b", "source": "shard", "meta": {"k": 1}}]
