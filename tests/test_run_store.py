"""`kiln run` with run.out_dir on S3 (a moto server on 127.0.0.1): stage folders published with DONE
last, skipped when done, downloaded when the local copy is missing, kept as previous-N when stale."""

import json
import shutil
from pathlib import Path

import pytest
from kiln_testing.recipes import mini_overrides, record_stages
from kiln_testing.s3 import s3_options

from kiln import pipeline, storage
from kiln.checkpoint import resolve_checkpoint
from kiln.errors import ConfigError
from kiln.recipe import load_recipe

STAGES = ["corpus", "tokenizer", "pack", "pretrain", "sample"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_stages(monkeypatch):
    """Replace the stage bodies with recorders so only the pipeline's own logic runs."""
    return record_stages(monkeypatch, check_inputs=True)


def s3_recipe(bucket, s3_server, *overrides):
    recipe = load_recipe(None, [f'run.out_dir="{bucket}/runs"', *overrides])
    storage.configure(s3_options(s3_server))  # load_recipe set the recipe's [storage] options
    return recipe


def test_stages_are_published_and_then_skipped(s3_bucket, s3_server, cache, fake_stages):
    recipe = s3_recipe(s3_bucket, s3_server)
    assert pipeline.run_recipe(recipe)["pack"] == {"stage": "pack"}
    assert fake_stages == STAGES
    run = f"{s3_bucket}/runs/tiny"
    for stage in STAGES:
        done = json.loads(storage.read_text(f"{run}/{stage}/DONE"))
        assert done["fingerprint"] == pipeline.fingerprint(recipe, stage)
        assert storage.read_text(f"{run}/{stage}/output.txt") == stage
    assert json.loads(storage.read_text(f"{run}/recipe.json"))["run"]["name"] == "tiny"
    assert not Path("s3:").exists()  # nothing written to a local folder named like the URL
    fake_stages.clear()
    assert pipeline.run_recipe(recipe)["sample"] == {"stage": "sample"}
    assert fake_stages == []


def test_a_later_stage_downloads_what_it_reads(s3_bucket, s3_server, cache, fake_stages):
    """Another machine (an empty cache): the stages it reruns find their inputs downloaded."""
    pipeline.run_recipe(s3_recipe(s3_bucket, s3_server))
    fake_stages.clear()
    shutil.rmtree(cache)
    pipeline.run_recipe(s3_recipe(s3_bucket, s3_server, "pack.val_fraction=0.2"))
    assert fake_stages == ["pack", "pretrain", "sample"]  # each asserted its inputs were local


def test_an_upload_killed_before_done_is_not_done(s3_bucket, s3_server, cache, fake_stages, monkeypatch):
    recipe = s3_recipe(s3_bucket, s3_server)
    real = storage.upload

    def dies_at_the_packs_marker(local, remote):
        if remote.endswith("/pack/DONE"):
            raise ConnectionError("upload killed")
        real(local, remote)

    monkeypatch.setattr(storage, "upload", dies_at_the_packs_marker)
    with pytest.raises(ConnectionError):
        pipeline.run_recipe(recipe)
    monkeypatch.setattr(storage, "upload", real)
    pack = f"{s3_bucket}/runs/tiny/pack"
    assert storage.isfile(f"{pack}/output.txt") and not storage.exists(f"{pack}/DONE")
    # Its staging copy holds a DONE, and still the stage is not done: the store's marker decides.
    assert (pipeline.stage_dir(recipe, "pack") / "DONE").is_file()
    assert not pipeline.is_done(recipe, "pack")
    fake_stages.clear()
    pipeline.run_recipe(recipe)
    assert fake_stages == ["pack", "pretrain", "sample"]
    assert storage.isfile(f"{pack}/DONE")


def test_a_changed_training_stage_is_kept_on_the_store(s3_bucket, s3_server, cache, fake_stages, capsys):
    pipeline.run_recipe(s3_recipe(s3_bucket, s3_server))
    run = f"{s3_bucket}/runs/tiny"
    storage.write_bytes(f"{run}/pretrain/checkpoints/step-00000001/manifest.json", b"{}")
    pipeline.run_recipe(s3_recipe(s3_bucket, s3_server, "train.lr=1e-3"))
    assert f"earlier output kept in {run}/pretrain.previous-1" in capsys.readouterr().out
    assert storage.isfile(f"{run}/pretrain.previous-1/DONE")
    assert storage.isfile(f"{run}/pretrain.previous-1/checkpoints/step-00000001/manifest.json")
    assert not storage.exists(f"{run}/pretrain/checkpoints")
    assert json.loads(storage.read_text(f"{run}/pretrain/DONE"))["inputs"]["train"]["lr"] == 1e-3


def test_what_the_store_cannot_hold_is_refused(s3_bucket, s3_server, cache, fake_stages):
    recipe = s3_recipe(s3_bucket, s3_server, 'run.stages=["corpus", "sft"]')
    with pytest.raises(ConfigError, match=r"run.out_dir: s3://.*the sft stage writes its folders to local disk"):
        pipeline.run_recipe(recipe)
    assert fake_stages == []
    with pytest.raises(ConfigError, match="run.out_dir"):
        recipe.run_dir  # noqa: B018 (a local run folder is asked for)
    recipe = s3_recipe(s3_bucket, s3_server, 'run.stages=["corpus", "data"]', 'data.executor="slurm"')
    with pytest.raises(ConfigError, match="run.out_dir.*slurm"):
        pipeline.run_recipe(recipe)


@pytest.mark.slow  # three short pipeline runs, ~20 s on 2 shared cores
def test_tiny_run_on_s3_trains_resumes_and_skips(s3_bucket, s3_server, cache):
    """corpus -> tokenizer -> pack -> pretrain for real: checkpoints straight to the store, a run
    killed after its last checkpoint resumes from S3 on another machine, then all is done."""
    stages = 'run.stages=["corpus", "tokenizer", "pack", "pretrain"]'
    recipe = s3_recipe(s3_bucket, s3_server, stages, *mini_overrides(max_steps=4, every=2))
    first = pipeline.run_recipe(recipe)
    pretrain = f"{s3_bucket}/runs/tiny/pretrain"
    assert storage.isfile(f"{pretrain}/checkpoints/step-00000004/manifest.json")
    assert storage.isfile(f"{pretrain}/metrics.jsonl") and storage.isfile(f"{pretrain}/DONE")
    assert not (pipeline.stage_dir(recipe, "pretrain") / "checkpoints").exists()  # only on the store
    local = resolve_checkpoint(pretrain)
    assert json.loads((local / "manifest.json").read_text())["step"] == 4
    assert first["pretrain"]["resumed_from"] is None
    # Killed before its DONE reached the store, on a machine whose cache is gone.
    storage.remove(f"{pretrain}/DONE")
    shutil.rmtree(cache)
    again = pipeline.run_recipe(recipe)
    assert again["pretrain"]["resumed_from"] == f"{pretrain}/checkpoints/step-00000004"
    assert storage.isfile(f"{pretrain}/DONE")
    assert pipeline.run_recipe(recipe)["pack"] == again["pack"]
    assert all(pipeline.is_done(recipe, s) for s in ("corpus", "tokenizer", "pack", "pretrain"))


def test_sharded_checkpoints_are_refused_by_run_out_dir(s3_bucket, s3_server, cache, tiny_pack_factory, monkeypatch):
    """A sharded layout (one-rank FSDP with offload, run on the CPU by lifting only the device
    check) writes DCP checkpoints, which go to local disk only: refused naming run.out_dir."""
    import torch.distributed as dist

    from kiln.parallel.config import ParallelConfig

    shape = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=16", "train.seq_len=16"]
    batch = ["train.micro_batch_size=2", "train.global_batch_tokens=64", "train.precision=fp32"]
    recipe = s3_recipe(s3_bucket, s3_server, 'run.stages=["pretrain"]', *shape, *batch, "parallel.offload=true")
    tiny_pack_factory(pipeline.stage_dir(recipe, "pack"))
    check = ParallelConfig.check_options
    monkeypatch.setattr(
        ParallelConfig, "check_options", lambda self, dp_shard, device_type: check(self, dp_shard, None)
    )
    out = pipeline.stage_dir(recipe, "pretrain")
    out.mkdir(parents=True)
    try:
        with pytest.raises(
            ConfigError, match=r"^run.out_dir: the pretrain stage cannot keep its checkpoints there: s3://"
        ):
            pipeline._pretrain(recipe, out)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
