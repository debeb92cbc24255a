"""Field mapping (kiln.data.fields): public dataset layouts in JSONL and Parquet become documents."""

import datetime
import json

import pytest

from kiln.config import build
from kiln.data.config import CurateConfig
from kiln.data.curate import curate, input_files
from kiln.data.fields import PRESETS, FieldMap
from kiln.data.readers import check_layout, read_documents
from kiln.errors import ConfigError, DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TS = datetime.datetime(2023, 1, 2, 3, 4, 5)
# One record per layout, with the columns the datasets' cards list.
LAYOUTS = {
    "refinedweb": {"content": "A refined web page.", "url": "https://a.example/1", "timestamp": TS, "dump": "CC-MAIN-2023-06", "segment": "1", "image_urls": [["x.png", "alt"]]},
    "pile": {"text": "A pile document.", "meta": {"pile_set_name": "Pile-CC", "other": 1}},
    "c4": {"text": "A C4 page.", "url": "https://c4.example/", "timestamp": "2019-04-25T12:57:54Z"},
    "fineweb": {"text": "A FineWeb page.", "id": "<urn:uuid:1>", "dump": "CC-MAIN-2024-10", "url": "https://f.example/", "date": "2024-02-20T11:10:44Z", "file_path": "s3://commoncrawl/x.warc.gz", "language": "en", "language_score": 0.93, "token_count": 5},
}  # fmt: skip
EXPECTED = {
    "refinedweb": {"id": "rw.{ext}:1", "text": "A refined web page.", "source": "rw", "meta": {"url": "https://a.example/1", "timestamp": "2023-01-02T03:04:05", "dump": "CC-MAIN-2023-06", "segment": "1"}},
    "pile": {"id": "rw.{ext}:1", "text": "A pile document.", "source": "rw", "meta": {"pile_set_name": "Pile-CC"}},
    "c4": {"id": "rw.{ext}:1", "text": "A C4 page.", "source": "rw", "meta": {"url": "https://c4.example/", "timestamp": "2019-04-25T12:57:54Z"}},
    "fineweb": {"id": "<urn:uuid:1>", "text": "A FineWeb page.", "source": "rw", "meta": {"url": "https://f.example/", "dump": "CC-MAIN-2024-10", "date": "2024-02-20T11:10:44Z", "file_path": "s3://commoncrawl/x.warc.gz", "language": "en", "language_score": 0.93, "token_count": 5}},
}  # fmt: skip


def write(tmp_path, record, ext):
    path = tmp_path / f"rw.{ext}"
    if ext == "parquet":
        pq.write_table(pa.Table.from_pylist([record]), path)
    else:
        path.write_text(json.dumps(record, default=str) + "\n")
    return path


def read(path, fields=None):
    pairs = list(read_documents(path, fields=fields))
    return [d for d, _ in pairs if d], [r for _, r in pairs if r]


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_presets_read_each_public_layout(tmp_path, layout, ext):
    record = dict(LAYOUTS[layout])
    if ext == "jsonl" and "timestamp" in record and isinstance(record["timestamp"], datetime.datetime):
        record["timestamp"] = record["timestamp"].isoformat()  # what a JSON export holds
    path = write(tmp_path, record, ext)
    docs, rejected = read(path, FieldMap.from_preset(layout))
    expected = json.loads(json.dumps(EXPECTED[layout]).replace("{ext}", ext))
    assert rejected == [] and docs == [expected]
    json.dumps(docs)  # Parquet timestamps came out as strings the part files can hold


def test_explicit_keys_and_dotted_paths(tmp_path):
    path = tmp_path / "x.jsonl"
    rows = [
        {"body": {"en": "first"}, "uid": 7, "src": "forum", "a": {"b": 1}, "url": "u"},
        {"body": {"en": "second"}, "uid": "k", "a.b": 2},  # a flat dotted name wins over the path
        {"body": {"fr": "troisieme"}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = FieldMap(text_key="body.en", id_key="uid", source_key="src", meta_keys=["a.b", "url"])
    docs, rejected = read(path, fields)
    assert docs == [
        {"id": "7", "text": "first", "source": "forum", "meta": {"b": 1, "url": "u"}},
        {"id": "k", "text": "second", "source": "x", "meta": {"b": 2}},
    ]
    assert [(r["line"], r["reason"]) for r in rejected] == [(3, "missing_text")]


def test_custom_text_key_without_meta_keys_keeps_every_other_field(tmp_path):
    path = write(tmp_path, {"content": "page", "url": "u", "text": "not the text"}, "jsonl")
    docs, _ = read(path, FieldMap(text_key="content"))
    assert docs == [{"id": "rw.jsonl:1", "text": "page", "source": "rw", "meta": {"url": "u", "text": "not the text"}}]


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_wrong_layout_is_one_line_naming_file_row_and_fix(tmp_path, ext):
    path = write(tmp_path, {"content": "x", "url": "u", "timestamp": "t"}, ext)
    with pytest.raises(DataError) as err:
        check_layout(path, None)
    unit = "row 0" if ext == "parquet" else "line 1"
    kind = "columns" if ext == "parquet" else "fields"
    assert str(err.value) == (
        f"{path}: {unit}: no field 'text' ({kind}: content, url, timestamp); "
        'set text_key = "content" or preset = "refinedweb"'
    )
    check_layout(path, FieldMap.from_preset("refinedweb"))  # the fix it names works


def test_one_odd_record_stays_a_rejection(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"body": "x"}) + "\n" + json.dumps({"text": "fine"}) + "\n")
    check_layout(path)  # a later record has the field: not a layout problem
    docs, rejected = read(path)
    assert [d["text"] for d in docs] == ["fine"] and [r["reason"] for r in rejected] == ["missing_text"]


def test_recipe_inputs_tables_and_strings(tmp_path):
    rw = write(tmp_path, LAYOUTS["refinedweb"], "parquet")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "plain doc", "id": "p"}) + "\n")
    cfg = build(CurateConfig, {"inputs": [{"path": str(rw), "preset": "refinedweb"}, str(plain)], "steps": []}, "data")
    cfg.validate()
    files = input_files(cfg)
    assert [(p.name, f.preset if f else None) for p, _, f in files] == [
        ("rw.parquet", "refinedweb"),
        ("plain.jsonl", None),
    ]
    stats = curate(cfg, tmp_path / "out", log=lambda *_: None)
    assert stats["docs_out"] == 2
    docs = [json.loads(line) for p in sorted((tmp_path / "out" / "docs").glob("*.jsonl")) for line in p.open()]
    assert sorted(d["text"] for d in docs) == ["A refined web page.", "plain doc"]

    wrong = build(CurateConfig, {"inputs": [str(rw)], "steps": []}, "data")
    with pytest.raises(DataError, match=r"rw\.parquet: row 0: no field 'text'.*preset = \"refinedweb\""):
        curate(wrong, tmp_path / "out2", log=lambda *_: None)


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"path": "x", "preset": "redpajama"},
            "inputs[0].preset: unknown preset 'redpajama'; known: " + ", ".join(PRESETS),
        ),
        ({"path": "x", "txt_key": "a"}, "inputs[0].txt_key: unknown key"),
        ({"preset": "c4"}, "inputs[0].path: each input table needs path"),
        ({"path": "x", "text_key": "a..b"}, "inputs[0].text_key: must be a field name or a dotted path"),
        ({"path": "x", "meta_keys": ["a.url", "url"]}, "inputs[0].meta_keys[1]: 'url' and 'a.url' would both"),
        ({"path": "x", "text_key": 3}, "inputs[0].text_key: expected a string"),
    ],
)
def test_bad_input_tables_refused_by_name(entry, message):
    cfg = build(CurateConfig, {"inputs": [entry], "steps": []}, "data")
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert str(err.value).startswith(message)


def test_field_table_on_text_files_refused(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("a note")
    cfg = build(CurateConfig, {"inputs": [{"path": str(tmp_path / "notes"), "text_key": "body"}], "steps": []}, "data")
    with pytest.raises(ConfigError, match=r"data\.inputs\[0\]: .*a\.txt is a text file"):
        input_files(cfg)
