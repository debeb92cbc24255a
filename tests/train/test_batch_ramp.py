"""Batch-size ramp: the global batch grows in whole micro-batches, as a pure function of the step."""

import json
from pathlib import Path

import pytest
import torch
from kiln_testing.train import tiny_train_config

from kiln.errors import ConfigError
from kiln.model import ModelConfig
from kiln.model.weights import load_weights
from kiln.recipe import load_recipe
from kiln.train.trainer import Trainer

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
MICRO = 16 * 4  # tokens per micro-batch


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


def _cfg(**overrides):
    ramp = dict(global_batch_tokens=4 * MICRO, eval_every=100, batch_ramp_steps=6, batch_ramp_start_tokens=MICRO)
    return tiny_train_config(**{**ramp, **overrides})


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_accumulation_schedule(pack, tmp_path):
    trainer = Trainer(MODEL, _cfg(), pack, tmp_path / "a")
    # From 1 to 4 micro-batches over 6 steps: 1 + 3 * step // 6.
    assert [trainer.accum_at(s) for s in range(9)] == [1, 1, 2, 2, 3, 3, 4, 4, 4]
    trainer = Trainer(MODEL, _cfg(batch_ramp_start_tokens=2 * MICRO, batch_ramp_steps=3), pack, tmp_path / "b")
    assert [trainer.accum_at(s) for s in range(5)] == [2, 2, 3, 4, 4]
    trainer = Trainer(MODEL, _cfg(batch_ramp_steps=0, batch_ramp_start_tokens=0), pack, tmp_path / "c")
    assert [trainer.accum_at(s) for s in range(3)] == [4, 4, 4]


def test_ramped_run_logs_and_counts_the_tokens_it_read(pack, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(MODEL, _cfg(), pack, out)
    calls = []
    step = trainer.train_step

    def count(micro_batches, **kwargs):
        calls.append(len(micro_batches))
        return step(micro_batches, **kwargs)

    trainer.train_step = count
    summary = trainer.fit()
    expected = [1, 1, 2, 2, 3, 3, 4, 4]
    assert calls == expected
    train = [r for r in _log(out) if r["kind"] == "train"]
    assert [r["batch_tokens"] for r in train] == [a * MICRO for a in expected]
    assert [r["tokens_seen"] for r in train] == [sum(expected[: i + 1]) * MICRO for i in range(8)]
    assert summary["tokens_seen"] == sum(expected) * MICRO
    events = [r for r in _log(out) if r["kind"] == "event"]
    assert [(r["step"], r["type"]) for r in events] == [(0, "batch_ramp"), (6, "batch_ramp")]
    assert events[0]["start_tokens"] == MICRO and events[0]["full_tokens"] == 4 * MICRO
    assert events[1]["batch_tokens"] == 4 * MICRO and events[1]["done"] is True
    # The loader read exactly the ramped number of sequences.
    assert trainer.train_loader.state_dict()["sequences"] == sum(expected) * 4


def test_resume_in_the_middle_of_the_ramp_equals_an_uninterrupted_run(pack, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    Trainer(MODEL, _cfg(), pack, straight).fit()
    # A new run folder continuing from the straight run's step-4 checkpoint (batch of 3 micro-batches next).
    trainer = Trainer(MODEL, _cfg(), pack, resumed, resume=str(straight / "checkpoints" / "step-00000004"))
    assert trainer.step == 4 and trainer.accum_at(trainer.step) == 3
    trainer.fit()
    _, expected, expected_manifest = load_weights(straight)
    _, got, manifest = load_weights(resumed)
    assert manifest["step"] == expected_manifest["step"] == 8
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert (
        manifest["loader"] == expected_manifest["loader"]
        and manifest["tokens_seen"] == expected_manifest["tokens_seen"]
    )
    straight_train = {r["step"]: r for r in _log(straight) if r["kind"] == "train"}
    for r in (r for r in _log(resumed) if r["kind"] == "train"):
        assert (r["loss"], r["batch_tokens"], r["tokens_seen"]) == (
            straight_train[r["step"]]["loss"],
            straight_train[r["step"]]["batch_tokens"],
            straight_train[r["step"]]["tokens_seen"],
        )


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["train.batch_ramp_steps=5"], "train.batch_ramp_start_tokens"),  # no start given
        (["train.batch_ramp_steps=5", "train.batch_ramp_start_tokens=32768"], "train.batch_ramp_start_tokens"),
        (["train.batch_ramp_steps=5", "train.batch_ramp_start_tokens=1000"], "train.batch_ramp_start_tokens"),
        (["train.batch_ramp_steps=-1"], "train.batch_ramp_steps"),
    ],
)
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_recipe(None, overrides)
    assert err.value.key == key
