"""The end of a stage reads as a person's summary (headline, outputs, next command), and every
verb that loads a model says which checkpoint and step it took, by the one rule (best, else latest)."""

import argparse
import json

import pytest
import torch
from kiln_testing.tokenizer import train_tiny_tokenizer

from kiln import pipeline, pipeline_verbs
from kiln.checkpoint import read_manifest, resolve_checkpoint, save_weights
from kiln.cli import main
from kiln.model import build_model
from kiln.model.config import ModelConfig
from kiln.recipe import load_recipe
from kiln.stage_summary import next_command, stage_lines

PRETRAIN_STATS = {
    "steps": 600,
    "tokens_seen": 1228800,
    "final_val_loss": 3.961234,
    "best_val_loss": 3.95,
    "final_val_bpb": 1.8345,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok"), ["def add(a, b):\n    return a + b\n"] * 40, 512)


def _checkpoints(root, tokenizer, best: int, latest: int):
    """A checkpoints root with step folders 1..latest, `best` and `latest` pointing where asked."""
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)
    for step in range(1, latest + 1):
        torch.manual_seed(step)
        save_weights(root / f"step-{step:08d}", cfg, build_model(cfg).state_dict(), {"step": step})
    (root / "latest").write_text(f"step-{latest:08d}\n")
    (root / "best").write_text(f"step-{best:08d}\n")
    return root


def test_a_stage_folder_resolves_to_best_and_resume_to_latest(tmp_path, tokenizer):
    root = _checkpoints(tmp_path / "pretrain" / "checkpoints", tokenizer, best=1, latest=2)
    assert resolve_checkpoint(tmp_path / "pretrain").name == "step-00000001"
    assert resolve_checkpoint(root).name == "step-00000001"
    assert resolve_checkpoint(root, pointer="latest").name == "step-00000002"
    (root / "best").unlink()  # a run without validation: latest
    assert resolve_checkpoint(root).name == "step-00000002"


def test_generate_and_export_name_the_checkpoint_they_loaded(tmp_path, tokenizer, capsys):
    stage = tmp_path / "pretrain"
    _checkpoints(stage / "checkpoints", tokenizer, best=1, latest=2)
    args = ["--tokenizer", str(tokenizer.path), "--max-new-tokens", "2", "--device", "cpu"]
    assert main(["generate", str(stage), "--prompt", "def", *args]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"loaded checkpoint {stage / 'checkpoints' / 'step-00000001'} (step 1, best)" in err
    assert main(["export", "single", str(stage), str(tmp_path / "single")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"loaded checkpoint {stage / 'checkpoints' / 'step-00000001'} (step 1, best)"
    assert read_manifest(tmp_path / "single")["step"] == 1


def test_pretrain_summary_is_formatted_with_outputs_and_next_command(tmp_path, tokenizer, monkeypatch, capsys):
    recipe = load_recipe(None, [f'run.out_dir="{tmp_path}"'])

    def fake(stage):
        def run(recipe, out, **_):
            if stage == "pretrain":
                _checkpoints(out / "checkpoints", tokenizer, best=1, latest=1)
                return PRETRAIN_STATS
            return {}

        return run

    monkeypatch.setattr(pipeline, "STAGE_RUNNERS", {s: fake(s) for s in pipeline.STAGE_RUNNERS})
    ns = argparse.Namespace(stages="corpus,tokenizer,pack,pretrain", force=False, recipe="my recipe.toml")
    pipeline_verbs._run_all(recipe, ns)
    out = capsys.readouterr().out.splitlines()
    ckpt = tmp_path / "tiny" / "pretrain" / "checkpoints" / "step-00000001"
    assert "[pretrain] val loss 3.96 (1.83 bits/byte), best 3.95 after 600 steps, 1,228,800 tokens" in out
    assert f"[pretrain] checkpoint: {ckpt}" in out
    assert out[-1] == "next: kiln sample 'my recipe.toml'"  # the recipe's next stage
    assert not any(line.lstrip().startswith(("{", "pretrain summary")) for line in out)  # no raw JSON
    # The machine-readable stats stay in stats.json.
    assert json.loads((tmp_path / "tiny" / "pretrain" / "stats.json").read_text()) == PRETRAIN_STATS


def test_the_last_model_stage_points_at_generate_and_serve(tmp_path, tokenizer):
    _checkpoints(tmp_path / "run" / "sft" / "checkpoints", tokenizer, best=1, latest=1)
    line = next_command("sft", ["pretrain", "sft"], "r.toml", tmp_path / "run" / "sft", "Q:")
    ckpt = tmp_path / "run" / "sft" / "checkpoints" / "step-00000001"
    assert line == f"next: kiln generate {ckpt} --prompt Q:   (or: kiln serve {ckpt})"
    assert next_command("pack", ["corpus", "pack"], None, tmp_path / "run" / "pack") == (
        f"next: kiln report {tmp_path / 'run'}"
    )


def test_data_stage_headlines_use_thousands_separators(tmp_path):
    stats = {"train": {"tokens": 1234567, "documents": 104}, "val": {"tokens": 9876, "documents": 1}}
    assert stage_lines("pack", tmp_path, stats) == [
        "[pack] 1,234,567 train tokens (104 documents), 9,876 validation tokens (1 documents)",
        f"[pack] output: {tmp_path}",
    ]


@pytest.mark.parametrize("bpb", [None, float("nan")])  # null since 2026-12-07; NaN in older summaries
def test_pretrain_headline_leaves_out_bits_per_byte_where_the_objective_has_none(tmp_path, bpb):
    """A BERT pretrain (masked tokens) counts no text bytes: loss and size only."""
    stats = {"final_val_loss": 7.5916, "final_val_bpb": bpb, "best_val_loss": 7.5916, "steps": 20, "tokens_seen": 6004}
    assert stage_lines("pretrain", tmp_path, stats)[0] == "[pretrain] val loss 7.59 after 20 steps, 6,004 tokens"
