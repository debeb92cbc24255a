"""What the validation metric covers: by default every window of the validation split once, with a
budget a fixed sample spread over it; the tokens and windows it covered are logged with it."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kiln_testing.train import tiny_train_config

from kiln.model import ModelConfig
from kiln.train.trainer import Trainer, validation_line

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
T = 16  # tiny_train_config's seq_len


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


def _val_tokens(pack: Path) -> np.ndarray:
    return np.fromfile(pack / "val" / "synthetic-00000.bin", dtype="<u2").astype(np.int64)


def _val_records(out: Path) -> list[dict]:
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r["kind"] == "val"]


def test_default_validation_is_the_whole_split_by_hand_and_logged(pack, tmp_path, capsys):
    out = tmp_path / "run"
    trainer = Trainer(MODEL, tiny_train_config(max_steps=4, eval_every=4, eval_batches=0), pack, out)
    summary = trainer.fit()
    tokens = _val_tokens(pack)
    windows = (len(tokens) - 1) // T
    assert windows % 4, "the split should end in a partial batch, to test that it is evaluated"
    [record] = _val_records(out)
    assert record["val_sequences"] == windows and record["val_tokens"] == windows * T
    assert summary["val_tokens"] == windows * T and summary["val_sequences"] == windows
    assert f"on {windows * T} tokens, {windows} sequences" in capsys.readouterr().out
    # The loss over all windows, computed here from the shard itself.
    starts = np.arange(windows) * T
    x = torch.from_numpy(np.stack([tokens[s : s + T] for s in starts]))
    y = torch.from_numpy(np.stack([tokens[s + 1 : s + T + 1] for s in starts]))
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(x).float()
    by_hand = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item() / y.numel()
    assert record["val_loss"] == pytest.approx(by_hand, rel=1e-5)


def _spy(trainer: Trainer, seen: list) -> None:
    """Record the batches of every evaluation."""
    evaluate = trainer.val_loader.validation_batches

    def recorded(limit, row_multiple=1):
        batches = list(evaluate(limit, row_multiple))
        seen.append(torch.cat([x for x, _ in batches]))
        yield from batches

    trainer.val_loader.validation_batches = recorded


def test_budgeted_validation_is_the_same_sample_at_every_evaluation_and_after_resume(pack, tmp_path):
    out, seen = tmp_path / "run", []
    first = Trainer(MODEL, tiny_train_config(max_steps=8, eval_every=4, eval_batches=3), pack, out)
    _spy(first, seen)
    first.fit()
    resumed = Trainer(MODEL, tiny_train_config(max_steps=12, eval_every=4, eval_batches=3), pack, out)
    assert resumed.resumed_from is not None
    _spy(resumed, seen)
    resumed.fit()
    assert len(seen) == 3 and all(torch.equal(s, seen[0]) for s in seen)
    assert seen[0].shape[0] == 3 * 4  # eval_batches global batches of micro_batch_size windows
    records = _val_records(out)
    assert [r["step"] for r in records] == [4, 8, 12]
    assert all(r["val_sequences"] == 12 and r["val_tokens"] == 12 * T for r in records)
    # Not the first windows of the split: the sample reaches its last quarter.
    tokens = _val_tokens(pack)
    windows = (len(tokens) - 1) // T
    last_quarter = {tuple(tokens[i * T : i * T + T]) for i in range(windows * 3 // 4, windows)}
    first_windows = {tuple(tokens[i * T : i * T + T]) for i in range(12)}
    sampled = {tuple(row.tolist()) for row in seen[0]}
    assert sampled & (last_quarter - first_windows)


def test_validation_line_leaves_out_an_undefined_bits_per_byte():
    """Post-training sources count no text bytes (val_bpb is None): the line says loss and size only."""
    result = {"val_loss": 0.41953, "val_bpb": None, "val_tokens": 802, "val_sequences": 43}
    assert validation_line(800, result) == "step 800 | val loss 0.4195 | on 802 tokens, 43 sequences"
    result = {**result, "val_bpb": 1.36891, "val_loss/replay": 3.5}
    assert validation_line(600, result, stopped_early=True) == (
        "step 600 | val loss 0.4195 | val bpb 1.3689 | on 802 tokens, 43 sequences | replay val loss 3.5000"
        " | early stop"
    )
