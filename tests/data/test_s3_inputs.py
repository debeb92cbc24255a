"""Documents read from and curated into S3 (a moto server on 127.0.0.1): the same records, ids and
sources as the same files on local disk."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln import storage
from kiln.data.config import CurateConfig
from kiln.data.curate import curate
from kiln.data.readers import list_named_inputs, read_inputs
from kiln.errors import DataError

DOCS = [{"id": f"d{i}", "text": f"Document number {i} says something long enough to keep."} for i in range(6)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))


def _layout(root):
    """web/a.jsonl, web/sub/b.parquet, web/.hidden.jsonl under a local folder."""
    (root / "web" / "sub").mkdir(parents=True)
    (root / "web" / "a.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS[:3]) + "not json\n")
    pq.write_table(pa.Table.from_pylist(DOCS[3:]), root / "web" / "sub" / "b.parquet")
    (root / "web" / ".hidden.jsonl").write_text(json.dumps(DOCS[0]) + "\n")
    return root / "web"


def _upload(local, url):
    for path in sorted(local.rglob("*")):
        if path.is_file():
            storage.upload(path, f"{url}/{path.relative_to(local).as_posix()}")


def test_s3_folder_and_glob_read_like_local(s3_bucket, cache, tmp_path):
    local = _layout(tmp_path / "local")
    _upload(local, f"{s3_bucket}/web")
    assert [n for _, n in list_named_inputs(f"{s3_bucket}/web")] == [n for _, n in list_named_inputs(local)]
    remote, here = list(read_inputs(f"{s3_bucket}/web")), list(read_inputs(local))
    assert [d for d, _ in remote] == [d for d, _ in here] and len([d for d, _ in here if d]) == len(DOCS)
    # A rejected line names the local copy it was read from (under KILN_CACHE), with its line.
    assert [{**r, "file": None} for _, r in remote if r] == [{**r, "file": None} for _, r in here if r]
    assert list(read_inputs(f"{s3_bucket}/web/**/*.parquet")) == list(read_inputs(f"{local}/**/*.parquet"))
    rejected = [r for _, r in read_inputs(f"{s3_bucket}/web/a.jsonl") if r]
    assert len(rejected) == 1 and rejected[0]["line"] == 4


def test_missing_s3_input_is_one_line(s3_bucket, cache):
    with pytest.raises(DataError, match=f"{s3_bucket}/nothing: no such file or folder"):
        list_named_inputs(f"{s3_bucket}/nothing")
    with pytest.raises(DataError, match="matches no JSONL"):
        list_named_inputs(f"{s3_bucket}/nothing/*.jsonl")


def test_changed_object_is_fetched_again(s3_bucket, cache):
    url = f"{s3_bucket}/a.jsonl"
    storage.write_bytes(url, (json.dumps(DOCS[0]) + "\n").encode())
    assert [d["id"] for d, _ in read_inputs(url)] == ["d0"]
    storage.write_bytes(url, (json.dumps(DOCS[1]) + "\n").encode())
    assert [d["id"] for d, _ in read_inputs(url)] == ["d1"]


def test_curate_into_s3_publishes_stats_last(s3_bucket, cache, tmp_path, monkeypatch):
    local = _layout(tmp_path / "local")
    _upload(local, f"{s3_bucket}/raw")
    cfg = CurateConfig(inputs=[f"{s3_bucket}/raw"], steps=["normalize"], tasks=2, workers=1)
    order = []
    real = storage.upload
    monkeypatch.setattr(storage, "upload", lambda path, url: (order.append(storage.name_of(url)), real(path, url)))
    stats = curate(cfg, f"{s3_bucket}/curated", log=lambda *a: None)
    assert order[-1] == "stats.json" and "funnel.html" in order
    assert json.loads(storage.read_text(f"{s3_bucket}/curated/stats.json")) == stats
    curate(cfg, tmp_path / "curated", log=lambda *a: None)
    remote_docs = sorted(d["id"] for d, _ in read_inputs(f"{s3_bucket}/curated/docs"))
    assert remote_docs == sorted(d["id"] for d, _ in read_inputs(tmp_path / "curated" / "docs"))
    assert len(remote_docs) == len(DOCS)
