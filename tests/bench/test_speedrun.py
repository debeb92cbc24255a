"""bench/speedrun.py's pure parts: the shared evaluation (HF logits over Kiln weights) gives Kiln's
own val bpb, the pack stream hands transformers Kiln's training rows in order, and the wall-clock
callback stops training once the budget has passed. No timing thresholds."""

import sys
from pathlib import Path

import pytest
import torch
from kiln_testing.train import make_tiny_pack

from kiln.data.loader import TokenLoader
from kiln.model import ModelConfig
from kiln.train.config import TrainConfig
from kiln.train.trainer import Trainer

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import speedrun  # noqa: E402

SEQ = 16


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    return make_tiny_pack(tmp_path_factory.mktemp("speedrun") / "pack")


@pytest.mark.parametrize("tie", [False, True])
def test_shared_bpb_equals_kilns_val_bpb(pack, tmp_path, tie):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ, tie_embeddings=tie)
    train = TrainConfig(seq_len=SEQ, micro_batch_size=4, global_batch_tokens=4 * SEQ, precision="fp32", compile=False)
    trainer = Trainer(cfg, train, pack, tmp_path / "out")
    with torch.no_grad():  # away from the init, so a wrong mapping (e.g. an untied head) shows
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    kiln = trainer.evaluate()
    shared = speedrun.shared_val_bpb(speedrun.hf_model_from_kiln(cfg, trainer.model.state_dict()), pack, SEQ, 4)
    assert shared["tokens"] == kiln["val_tokens"]
    assert shared["val_bpb"] == pytest.approx(kiln["val_bpb"], rel=1e-4)
    assert shared["val_loss"] == pytest.approx(kiln["val_loss"], rel=1e-4)


def test_pack_rows_are_kilns_training_rows_in_order(pack):
    rows = iter(speedrun.PackRows(pack, SEQ, 4, seed=7))
    loader = iter(TokenLoader(pack, split="train", seq_len=SEQ, batch_size=4, seed=7))
    for _ in range(3):
        x, _y = next(loader)
        for want in x:
            row = next(rows)
            assert torch.equal(row["input_ids"], want.long()) and torch.equal(row["labels"], want.long())


class FakeControl:
    should_training_stop = False


class FakeState:
    global_step = 0


def test_wall_clock_stop_stops_at_the_budget():
    now = [100.0]
    stop = speedrun.wall_clock_stop(budget_s=10.0, start=100.0, clock=lambda: now[0])
    control, state = FakeControl(), FakeState()
    for step, t in enumerate([103.0, 109.9, 110.0], start=1):
        now[0], state.global_step = t, step
        stop.on_step_end(None, state, control)
        assert control.should_training_stop is (t >= 110.0)
    assert stop.steps == [(1, 3.0), (2, pytest.approx(9.9)), (3, 10.0)]
    stop.on_log(None, state, control, logs={"loss": 2.5})
    assert stop.losses == [(3, 10.0, 2.5)]


def test_first_reaching_and_steady_rate():
    scored = [(5, 10.0, 3.0), (10, 20.0, 2.0), (15, 30.0, 1.5)]
    assert speedrun.first_reaching(scored, 2.0) == (10, 20.0, 2.0)
    assert speedrun.first_reaching(scored, 1.0) is None
    steps = [(i, float(i)) for i in range(1, 11)]  # one step a second after step 1
    assert speedrun.steady_tokens_per_s(steps, 100, skip=2) == pytest.approx(100.0)


def test_variant_keys_change_only_kilns_train_config():
    args = speedrun.argparse.Namespace(threads=1, max_steps=50, no_compile=True, precision="fp32")
    base = speedrun.kiln_train_config([], args)
    name, keys = speedrun.parse_variant(
        "adamw:train.optimizer=adamw, train.muon_adjust_lr=original, train.max_steps=20"
    )
    variant = speedrun.kiln_train_config([], args, keys)
    assert name == "adamw" and keys == ["train.optimizer=adamw", "train.muon_adjust_lr=original", "train.max_steps=20"]
    assert (base.optimizer, base.max_steps, base.compile, base.precision, base.threads) == (
        "muon",  # the shipped recipe's
        50,
        False,
        "fp32",
        1,
    )
    # The variant's keys win over the bench's flags; no evaluation or checkpoint inside the budget.
    assert (variant.optimizer, variant.max_steps, variant.compile) == ("adamw", 20, False)
    assert (variant.eval_every, variant.ckpt_every) == (20, 20)


@pytest.mark.parametrize("text", ["muon", "muon:", ":train.lr=1", "qk:model.qk_norm=true", "x:train.lr"])
def test_variant_that_is_not_train_overrides_is_refused(text):
    with pytest.raises(SystemExit, match="--variant"):
        speedrun.parse_variant(text)
