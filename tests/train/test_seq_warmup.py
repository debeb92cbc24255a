"""Sequence-length warmup: early steps train on shorter windows of the same tokens, as a pure
function of the step."""

import json
from pathlib import Path

import pytest
import torch
from kiln_testing.train import tiny_train_config

from kiln.errors import ConfigError
from kiln.model import ModelConfig
from kiln.model.weights import load_weights
from kiln.recipe import load_recipe
from kiln.train.config import TrainConfig
from kiln.train.objective import next_token_loss
from kiln.train.seq_warmup import split_windows, window_len_at, window_lengths
from kiln.train.trainer import Trainer

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


def _cfg(**overrides):
    warm = dict(eval_every=100, seq_len_warmup_steps=6, seq_len_start=4)
    return tiny_train_config(**{**warm, **overrides})


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_window_length_climbs_through_divisors_of_seq_len():
    cfg = TrainConfig(seq_len=256, global_batch_tokens=2048, max_steps=200, seq_len_warmup_steps=90, seq_len_start=64)
    lengths = [window_len_at(s, cfg) for s in range(120)]
    # Linear target 64 + 192 s / 90 rounded down to a divisor of 256: 64 until the target reaches
    # 128 (step 30), 128 until it would reach 256 (step 90), then the full length.
    assert lengths[:30] == [64] * 30 and lengths[30:90] == [128] * 60 and set(lengths[90:]) == {256}
    assert window_lengths(cfg) == [64, 128, 256]
    cfg = TrainConfig(seq_len=24, global_batch_tokens=48, max_steps=20, seq_len_warmup_steps=10, seq_len_start=3)
    assert window_lengths(cfg) == [3, 4, 6, 8, 12, 24]
    assert window_lengths(TrainConfig()) == [TrainConfig().seq_len]


def test_split_windows_keeps_every_token_and_its_target():
    stream = torch.arange(2 * 16 + 1)
    rows = torch.stack([stream[:16], stream[16:32]]), torch.stack([stream[1:17], stream[17:33]])
    inputs, targets = split_windows(rows, 4)
    assert inputs.shape == targets.shape == (8, 4)
    assert torch.equal(inputs.flatten(), stream[:32]) and torch.equal(targets, inputs + 1)
    assert split_windows(rows, 16) is rows


def test_warmup_run_trains_on_short_windows_then_full_length(pack, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(MODEL, _cfg(), pack, out)
    shapes = []
    step = trainer.train_step

    def record(micro_batches, **kwargs):
        shapes.append(tuple(micro_batches[0][0].shape))
        return step(micro_batches, **kwargs)

    trainer.train_step = record
    summary = trainer.fit()
    # seq_len 16 from 4 over 6 steps: target 4 + 2 s -> divisors 4, 4, 8, 8, 8, 8, then 16.
    assert shapes == [(16, 4), (16, 4), (8, 8), (8, 8), (8, 8), (8, 8), (4, 16), (4, 16)]
    train = [r for r in _log(out) if r["kind"] == "train"]
    assert [r["window_len"] for r in train] == [4, 4, 8, 8, 8, 8, 16, 16]
    assert [r["batch_tokens"] for r in train] == [64] * 8  # the same tokens every step
    assert summary["tokens_seen"] == 8 * 64
    assert trainer.train_loader.state_dict()["sequences"] == 8 * 4


def test_short_windows_change_the_training(pack, tmp_path):
    """The losses of the warmup steps differ from a run without warmup (the model sees less
    context), and agree once both train at full length from the same weights."""
    warm, plain = tmp_path / "warm", tmp_path / "plain"
    Trainer(MODEL, _cfg(max_steps=3, seq_len_warmup_steps=2), pack, warm).fit()
    Trainer(MODEL, _cfg(max_steps=3, seq_len_warmup_steps=0, seq_len_start=0), pack, plain).fit()
    first = [next(r["loss"] for r in _log(d) if r["kind"] == "train") for d in (warm, plain)]
    assert first[0] != pytest.approx(first[1], rel=1e-4)


def test_resume_inside_the_warmup_equals_an_uninterrupted_run(pack, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    Trainer(MODEL, _cfg(), pack, straight).fit()
    trainer = Trainer(MODEL, _cfg(), pack, resumed, resume=str(straight / "checkpoints" / "step-00000004"))
    assert trainer.step == 4 and window_len_at(trainer.step, trainer.cfg) == 8
    trainer.fit()
    _, expected, _ = load_weights(straight)
    _, got, _ = load_weights(resumed)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_a_stage_with_its_own_loss_is_refused(pack, tmp_path):
    with pytest.raises(ConfigError) as err:
        Trainer(MODEL, _cfg(), pack, tmp_path / "r", loss_fn=next_token_loss)
    assert err.value.key == "train.seq_len_warmup_steps"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["train.seq_len_start=64"], "train.seq_len_start"),  # start without steps
        (["train.seq_len_warmup_steps=50"], "train.seq_len_start"),  # steps without start
        (["train.seq_len_warmup_steps=50", "train.seq_len_start=100"], "train.seq_len_start"),  # not a divisor
        (["train.seq_len_warmup_steps=50", "train.seq_len_start=256"], "train.seq_len_start"),  # not below
        (["train.seq_len_warmup_steps=100000", "train.seq_len_start=64"], "train.seq_len_warmup_steps"),
        (["train.seq_len_warmup_steps=-3"], "train.seq_len_warmup_steps"),
    ],
)
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_recipe(None, overrides)
    assert err.value.key == key
