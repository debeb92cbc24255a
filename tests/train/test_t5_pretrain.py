"""recipes/tiny-t5.toml through `kiln run`, shrunk (slow): span-corruption pretraining of a T5 on
the built-in corpus, its validation loss falling at every evaluation."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_tiny_t5_recipe_loss_falls(tmp_path):
    cmd = [
        sys.executable, "-m", "kiln.cli", "run", "recipes/tiny-t5.toml", f'run.out_dir="{tmp_path}"',
        "corpus.max_bytes_per_source=300000", "tokenizer.vocab_size=1024", "train.max_steps=40", "train.eval_every=10",
    ]  # fmt: skip
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    records = [json.loads(line) for line in (tmp_path / "tiny-t5" / "pretrain" / "metrics.jsonl").open()]
    val = [r["val_loss"] for r in records if r["kind"] == "val"]
    assert len(val) == 4 and all(b < a for a, b in zip(val, val[1:])), val
    assert val[-1] < val[0] - 0.5, val
    manifest = json.loads(next((tmp_path / "tiny-t5" / "pretrain" / "checkpoints").glob("*/manifest.json")).read_text())
    assert manifest["model_config"]["arch"] == "t5"
