"""kiln.storage against a real S3-compatible server (moto, started by the session on 127.0.0.1)."""

import pytest

from kiln import storage
from kiln.errors import ConfigError
from kiln.recipe import load_recipe


def test_paths_without_a_protocol_stay_local(tmp_path):
    assert not storage.is_remote(str(tmp_path)) and not storage.is_remote(tmp_path)
    assert not storage.is_remote(f"file://{tmp_path}")
    assert storage.is_remote("s3://bucket/key") and storage.is_remote("memory://x")
    assert storage.join(tmp_path, "a", "b") == tmp_path / "a" / "b"
    assert storage.join("s3://b/root/", "a", "b") == "s3://b/root/a/b"
    assert storage.parent_of("s3://b/root/a") == "s3://b/root" and storage.name_of("s3://b/root/a/") == "a"


def test_unknown_protocol_is_one_line():
    with pytest.raises(ConfigError, match="no file system for nosuchfs://"):
        storage.filesystem("nosuchfs://x/y")


def test_write_read_glob_on_s3(s3_bucket):
    storage.write_bytes(f"{s3_bucket}/d/a.jsonl", b"one\n")
    storage.write_bytes(f"{s3_bucket}/d/sub/b.jsonl", b"two\n")
    assert storage.read_text(f"{s3_bucket}/d/a.jsonl") == "one\n"
    assert storage.isfile(f"{s3_bucket}/d/a.jsonl") and storage.isdir(f"{s3_bucket}/d")
    assert storage.glob(f"{s3_bucket}/d/**/*.jsonl") == [f"{s3_bucket}/d/a.jsonl", f"{s3_bucket}/d/sub/b.jsonl"]
    assert storage.walk_files(f"{s3_bucket}/d") == [f"{s3_bucket}/d/a.jsonl", f"{s3_bucket}/d/sub/b.jsonl"]


def test_publish_uploads_the_marker_last(s3_bucket, tmp_path, monkeypatch):
    for name in ("a.bin", "b.bin", "DONE"):
        (tmp_path / name).write_text(name)
    order = []
    real = storage.upload
    monkeypatch.setattr(storage, "upload", lambda local, remote: (order.append(local.name), real(local, remote)))
    storage.publish_folder(tmp_path, f"{s3_bucket}/out", "DONE")
    assert order == ["a.bin", "b.bin", "DONE"]
    assert storage.read_text(f"{s3_bucket}/out/DONE") == "DONE"


def test_republish_unpublishes_first(s3_bucket, tmp_path, monkeypatch):
    (tmp_path / "a.bin").write_text("new")
    (tmp_path / "DONE").write_text("new")
    storage.write_bytes(f"{s3_bucket}/out/a.bin", b"old")
    storage.write_bytes(f"{s3_bucket}/out/DONE", b"old")

    def killed(local, remote):
        raise ConnectionError("upload killed")

    monkeypatch.setattr(storage, "upload", killed)
    with pytest.raises(ConnectionError):
        storage.publish_folder(tmp_path, f"{s3_bucket}/out", "DONE")
    # The old marker is gone before any new file went up: no marker over mixed old and new files.
    assert not storage.exists(f"{s3_bucket}/out/DONE")


def test_recipe_storage_table_reaches_fsspec(s3_server, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[storage.s3]\nendpoint_url = "{s3_server}"\nclient_kwargs = {{region_name = "eu-west-1"}}\n')
    try:
        load_recipe(recipe)
        fs = storage.filesystem("s3://any")
        assert fs.client_kwargs == {"region_name": "eu-west-1"} and fs.endpoint_url == s3_server
    finally:
        storage.configure({})


def test_recipe_refuses_credentials(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[storage.s3]\nsecret = "hunter2"\n')
    with pytest.raises(ConfigError, match=r"storage\.s3\.secret: credentials do not belong in a recipe"):
        load_recipe(recipe)


def test_endpoint_and_credentials_from_the_aws_environment(s3_server, monkeypatch):
    s3fs = pytest.importorskip("s3fs")
    storage.configure({})
    for name, value in (
        ("AWS_ENDPOINT_URL", s3_server),
        ("AWS_ACCESS_KEY_ID", "env"),
        ("AWS_SECRET_ACCESS_KEY", "env"),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3fs.S3FileSystem.clear_instance_cache()  # an instance made before the variables were set
    try:
        storage.filesystem("s3://kiln-env").mkdir("kiln-env")
        storage.write_bytes("s3://kiln-env/a.txt", b"from the environment")
        assert storage.read_text("s3://kiln-env/a.txt") == "from the environment"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
