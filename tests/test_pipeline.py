import json

import pytest
from kiln_testing.recipes import record_stages

from kiln import pipeline
from kiln.recipe import load_recipe


@pytest.fixture
def fake_stages(monkeypatch):
    """Replace the stage bodies with recorders so only the pipeline's own logic runs."""
    return record_stages(monkeypatch)


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


def test_dropping_an_earlier_post_stage_reruns_the_ones_after_it(tmp_path, fake_stages, capsys):
    """GRPO starts from the post stage before it in run.stages; without DPO that is SFT, so the
    GRPO that started from DPO is stale although no section GRPO reads changed."""
    with_dpo = 'run.stages=["corpus", "tokenizer", "pack", "pretrain", "sft", "dpo", "grpo"]'
    pipeline.run_recipe(recipe(tmp_path, with_dpo))
    fake_stages.clear()
    pipeline.run_recipe(recipe(tmp_path, 'run.stages=["corpus", "tokenizer", "pack", "pretrain", "sft", "grpo"]'))
    assert fake_stages == ["grpo"]
    assert "chain.stages_before: ['sft', 'dpo'] -> ['sft']" in capsys.readouterr().out
    fake_stages.clear()
    pipeline.run_recipe(recipe(tmp_path, with_dpo))
    assert fake_stages == ["grpo"]  # dpo's own output is still current


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


def test_stale_training_stage_keeps_every_earlier_generation(tmp_path, fake_stages, capsys):
    """Each change of a training stage's inputs moves its output to a new .previous-N; none is
    deleted, and the line says which keys changed."""
    run = tmp_path / "tiny"
    pipeline.run_recipe(recipe(tmp_path))
    (run / "pretrain" / "checkpoint").write_text("first")
    pipeline.run_recipe(recipe(tmp_path, "train.lr=1e-3"))
    assert "[pretrain] inputs changed (train.lr: 0.003 -> 0.001)" in capsys.readouterr().out
    (run / "pretrain" / "checkpoint").write_text("second")
    pipeline.run_recipe(recipe(tmp_path, "train.lr=2e-3", "model.dim=64"))
    out = capsys.readouterr().out
    assert "[pretrain] inputs changed (model.dim: 256 -> 64; train.lr: 0.001 -> 0.002)" in out
    assert (run / "pretrain.previous-1" / "checkpoint").read_text() == "first"
    assert (run / "pretrain.previous-2" / "checkpoint").read_text() == "second"
    assert not (run / "pretrain" / "checkpoint").exists()
    assert json.loads((run / "pretrain" / "DONE").read_text())["fingerprint"]
    assert not (run / "pretrain" / "DONE.tmp").exists()


def test_a_larger_max_steps_extends_a_finished_pretrain(tmp_path, fake_stages, monkeypatch):
    """Only train.max_steps grew: the stage keeps its folder and runs again with resume=auto (the
    trainer continues from the newest checkpoint); the old marker is kept in extensions.jsonl."""
    resumes = []
    runner = pipeline.STAGE_RUNNERS["pretrain"]

    def pretrain(recipe, out, **kwargs):
        resumes.append(kwargs["resume"])
        return runner(recipe, out, **kwargs)

    monkeypatch.setitem(pipeline.STAGE_RUNNERS, "pretrain", pretrain)
    run = tmp_path / "tiny"
    pipeline.run_recipe(recipe(tmp_path))
    (run / "pretrain" / "checkpoint").write_text("weights")
    first = json.loads((run / "pretrain" / "DONE").read_text())
    fake_stages.clear()
    pipeline.run_recipe(recipe(tmp_path, "train.max_steps=700"))
    assert fake_stages == ["pretrain", "sample"] and resumes == ["auto", "auto"]
    assert (run / "pretrain" / "checkpoint").read_text() == "weights"
    assert not list(tmp_path.glob("tiny/pretrain.previous*"))
    assert json.loads((run / "pretrain" / "extensions.jsonl").read_text()) == first
    assert json.loads((run / "pretrain" / "DONE").read_text())["inputs"]["train"]["max_steps"] == 700
    assert not [p.name for p in (run / "pretrain").iterdir() if p.name.endswith(".tmp")]
    # Fewer steps, or max_steps changed together with another key, is a new run.
    pipeline.run_recipe(recipe(tmp_path, "train.max_steps=500"))
    assert (run / "pretrain.previous-1" / "checkpoint").read_text() == "weights"


def test_unknown_stage_is_named_before_any_work(tmp_path, capsys):
    from kiln.cli import main

    assert main(["run", "recipes/tiny.toml", f'run.out_dir="{tmp_path}"', "--stages", "corpus,pretrian"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "kiln: error: <command line>: --stages: unknown stage 'pretrian' (did you mean 'pretrain'?); the stages are corpus,"
    )
    assert "Traceback" not in err and not (tmp_path / "tiny" / "corpus").exists()


def test_a_missing_resume_path_fails_before_any_stage(tmp_path, capsys):
    from kiln.cli import main

    missing = tmp_path / "nonexistent"
    assert main(["pretrain", "recipes/tiny.toml", f'run.out_dir="{tmp_path}"', "--resume", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {missing}: no such checkpoint" in err
    assert not (tmp_path / "tiny" / "corpus").exists()
