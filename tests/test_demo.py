"""The README's main command, exactly as shipped: the demo recipe end to end on real text (slow)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_recipe_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "kiln.cli", "run", "recipes/data-demo.toml", f'run.out_dir="{tmp_path}"']
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    run_dir = tmp_path / "data-demo"
    evals = [json.loads(line) for line in (run_dir / "pretrain" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in evals if r["kind"] == "val"]
    assert len(val) >= 3
    # Validation loss falls at every evaluation of the demo and ends far below the first one.
    assert all(b < a for a, b in zip(val, val[1:])), val
    assert val[-1] < val[0] - 1.0, val
    assert "val loss" in result.stdout and "--- sample 0" in result.stdout
    tokenizer_stats = json.loads((run_dir / "tokenizer" / "stats.json").read_text())
    assert tokenizer_stats["bytes_per_token"] > 2.5  # BPE on English prose and code compresses
    data_stats = json.loads((run_dir / "data" / "stats.json").read_text())
    assert 0 < data_stats["docs_out"] < data_stats["docs_in"]  # curation dropped some, kept most
    assert "minhash_dedup" in result.stdout  # the funnel was printed
    assert "minhash_duplicate" in (run_dir / "data" / "funnel.html").read_text()  # and drawn
    for stage in ("corpus", "data", "tokenizer", "pack", "pretrain", "sample"):
        assert (run_dir / stage / "DONE").exists()
