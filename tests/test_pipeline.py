import json

import pytest

from kiln import pipeline
from kiln.recipe import load_recipe


@pytest.fixture
def fake_stages(monkeypatch):
    """Replace the stage bodies with recorders so only the pipeline's own logic runs."""
    calls = []

    def make(stage):
        def run(recipe, out, **kwargs):
            calls.append(stage)
            (out / "output.txt").write_text(stage)
            return {"stage": stage}

        return run

    monkeypatch.setattr(pipeline, "STAGE_RUNNERS", {s: make(s) for s in pipeline.STAGE_RUNNERS})
    return calls


def recipe(tmp_path, *overrides):
    return load_recipe(None, [f'run.out_dir="{tmp_path}"', *overrides])


def test_runs_in_order_and_skips_done(tmp_path, fake_stages):
    r = recipe(tmp_path)
    results = pipeline.run_recipe(r)
    assert fake_stages == ["corpus", "tokenizer", "pack", "pretrain", "sample"]
    assert results["pack"] == {"stage": "pack"}
    assert json.loads((tmp_path / "tiny" / "recipe.json").read_text())["run"]["name"] == "tiny"
    fake_stages.clear()
    assert pipeline.run_recipe(r)["pack"] == {"stage": "pack"}
    assert fake_stages == []


def test_changed_section_rebuilds_stage_and_downstream(tmp_path, fake_stages):
    pipeline.run_recipe(recipe(tmp_path))
    fake_stages.clear()
    pipeline.run_recipe(recipe(tmp_path, "tokenizer.vocab_size=4096"))
    assert fake_stages == ["tokenizer", "pack", "pretrain", "sample"]
    fake_stages.clear()
    pipeline.run_recipe(recipe(tmp_path, "tokenizer.vocab_size=4096", "sample.prompt=x"))
    assert fake_stages == ["sample"]


def test_stage_order_is_pipeline_order_not_list_order(tmp_path, fake_stages):
    pipeline.run_recipe(recipe(tmp_path, 'run.stages=["pack", "corpus"]'))
    assert fake_stages == ["corpus", "pack"]


def test_partial_stage_rebuilt_but_partial_pretrain_kept(tmp_path, fake_stages):
    r = recipe(tmp_path)
    for stage in ("pack", "pretrain"):
        (tmp_path / "tiny" / stage).mkdir(parents=True)
        (tmp_path / "tiny" / stage / "leftover").write_text("partial")
    pipeline.run_recipe(r, ["pack", "pretrain"])
    assert not (tmp_path / "tiny" / "pack" / "leftover").exists()
    assert (tmp_path / "tiny" / "pretrain" / "leftover").exists()  # checkpoints to resume from


def test_force_reruns(tmp_path, fake_stages):
    r = recipe(tmp_path)
    pipeline.run_recipe(r, ["corpus"])
    pipeline.run_recipe(r, ["corpus"], force=True)
    assert fake_stages == ["corpus", "corpus"]


def test_stale_training_stage_kept_one_generation_back(tmp_path, fake_stages):
    pipeline.run_recipe(recipe(tmp_path))
    (tmp_path / "tiny" / "pretrain" / "checkpoint").write_text("weights")
    pipeline.run_recipe(recipe(tmp_path, "train.max_steps=700"))
    previous = tmp_path / "tiny" / "pretrain.previous"
    assert (previous / "checkpoint").read_text() == "weights"
    assert not (tmp_path / "tiny" / "pretrain" / "checkpoint").exists()
    assert json.loads((tmp_path / "tiny" / "pretrain" / "DONE").read_text())["fingerprint"]
    assert not [p.name for p in (tmp_path / "tiny" / "pretrain").iterdir() if p.name.endswith(".tmp")]
