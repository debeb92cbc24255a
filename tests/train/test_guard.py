"""The loss-spike and NaN guard: the detector on its statistic, and planted bad batches in real runs."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from kiln_testing.train import tiny_train_config

from kiln.data.loader import TokenLoader
from kiln.errors import ConfigError, TrainingDiverged
from kiln.model import ModelConfig, build_model
from kiln.model.weights import load_weights
from kiln.recipe import load_recipe
from kiln.train import trainer as trainer_module
from kiln.train.config import GuardConfig
from kiln.train.guard import LossGuard, grad_group
from kiln.train.schedule import lr_at
from kiln.train.trainer import Trainer, next_token_loss

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
STEPS = 20
BAD_STEP = 10


# ---- the detector --------------------------------------------------------------------------------


def _noisy(n, level=2.0, amplitude=0.05):
    """A deterministic wobble around `level`: mean `level`, std about amplitude / sqrt(2)."""
    return [level + amplitude * math.sin(1.3 * i) for i in range(n)]


def test_spike_is_a_rise_of_k_sigma_over_the_window_mean():
    history = _noisy(20)
    mean = sum(history) / 20
    std = math.sqrt(sum((x - mean) ** 2 for x in history) / 19)

    def primed():
        guard = LossGuard(GuardConfig(spike_sigma=6, spike_min_rise=0.01, window=20, min_history=10))
        for loss in history:
            assert guard.check(loss, 1.0) is None
        return guard

    assert primed().check(mean + 5.95 * std, 1.0) is None
    guard = primed()
    flagged = guard.check(mean + 6.05 * std, 1.0)
    assert flagged is not None and flagged.type == "spike"
    assert flagged.details["mean"] == pytest.approx(mean) and flagged.details["std"] == pytest.approx(std)
    assert flagged.details["sigma"] == pytest.approx(6.05)
    assert guard.events == 1


def test_no_spike_before_min_history_and_flagged_losses_stay_out_of_the_history():
    guard = LossGuard(GuardConfig(spike_sigma=3, spike_min_rise=0.0, window=10, min_history=5))
    for loss in _noisy(4):
        assert guard.check(loss, 1.0) is None
    assert guard.check(100.0, 1.0) is None  # only 4 losses seen: no judgement yet (and 100 joins them)
    guard = LossGuard(GuardConfig(spike_sigma=3, spike_min_rise=0.0, window=10, min_history=5))
    for loss in _noisy(5):
        guard.check(loss, 1.0)
    before = list(guard.history)
    assert guard.check(100.0, 1.0).type == "spike"
    assert list(guard.history) == before
    # A falling loss is never a spike, however fast it falls.
    assert guard.check(0.1, 1.0) is None


def test_window_forgets_old_losses():
    guard = LossGuard(GuardConfig(spike_sigma=3, spike_min_rise=0.0, window=5, min_history=5))
    for loss in _noisy(5, level=1.0) + _noisy(5, level=0.5, amplitude=0.01):
        guard.check(loss, 1.0)
    assert max(guard.history) < 0.6
    # 1.0 was normal five steps ago; against the recent window it is a spike.
    assert guard.check(1.0, 1.0).type == "spike"


def test_min_rise_keeps_a_flat_curve_noise_from_being_a_spike():
    guard = LossGuard(GuardConfig(spike_sigma=6, spike_min_rise=0.1, window=10, min_history=10))
    for loss in _noisy(10, level=1.0, amplitude=1e-5):
        guard.check(loss, 1.0)
    assert guard.check(1.05, 1.0) is None  # thousands of sigmas, but a rise of 0.05 nats
    assert guard.check(1.2, 1.0).type == "spike"


def test_non_finite_loss_or_gradient_is_flagged():
    guard = LossGuard(GuardConfig(spike_sigma=0))
    assert guard.check(float("nan"), 1.0).type == "nan"
    assert guard.check(2.0, float("inf")).type == "nan"
    assert guard.check(1e9, 1.0) is None  # spike_sigma=0: only NaN/inf are looked for
    assert guard.events == 2
    # Under fp16 the grad scaler owns overflowing gradients: not an event, and not history either.
    fp16 = LossGuard(GuardConfig(), scaler_handles_overflow=True)
    assert fp16.check(2.0, float("inf")) is None
    assert fp16.events == 0 and len(fp16.history) == 0
    assert fp16.check(float("inf"), float("inf")).type == "nan"


def test_max_events_and_state_round_trip():
    guard = LossGuard(GuardConfig(max_events=2, window=4, min_history=2))
    for loss in (3.0, 2.9, float("nan"), 2.8, float("nan")):
        guard.check(loss, 1.0)
    assert guard.events == 2 and not guard.exhausted()
    guard.check(float("nan"), 1.0)
    assert guard.exhausted()
    copy = LossGuard(GuardConfig(max_events=2, window=4, min_history=2))
    copy.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert list(copy.history) == [3.0, 2.9, 2.8] and copy.events == 3
    assert not LossGuard(GuardConfig(max_events=0)).exhausted()


@pytest.mark.parametrize(
    "override, key",
    [
        ("action=retry", "train.guard.action"),
        ("window=1", "train.guard.window"),
        ("min_history=500", "train.guard.min_history"),
        ("lr_factor=0", "train.guard.lr_factor"),
        ("lr_factor=1.5", "train.guard.lr_factor"),
        ("spike_sigma=-1", "train.guard.spike_sigma"),
        ("max_events=-1", "train.guard.max_events"),
        ("spike_min_rise=nan", "train.guard.spike_min_rise"),
    ],
)
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_recipe(None, [f"train.guard.{override}"])
    assert err.value.key == key


def test_grad_groups_of_the_transformer():
    model = build_model(
        ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32, vocab_size=64, pos="learned")
    )
    groups = {name: grad_group(name) for name, _ in model.named_parameters()}
    assert groups == {
        "tok_embeddings.weight": "embed",
        "pos_embeddings.weight": "embed",
        "layers.0.attn_norm.weight": "norm",
        "layers.0.attn.wqkv.weight": "attn",
        "layers.0.attn.wo.weight": "attn",
        "layers.0.ffn_norm.weight": "norm",
        "layers.0.ffn.w1.weight": "mlp",
        "layers.0.ffn.w3.weight": "mlp",
        "layers.0.ffn.w2.weight": "mlp",
        "norm.weight": "norm",
        "output.weight": "head",
    }
    assert grad_group("layers.3.attn.q_norm.weight") == "norm"
    assert grad_group("layers.0.attn.wqkv.lora_a") == "attn"
    assert grad_group("_orig_mod.layers.0.ffn.experts.w1") == "mlp"
    assert grad_group("value_head.weight") == "other"


# ---- planted bad batches in real runs ------------------------------------------------------------


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


def _cfg(**guard):
    return tiny_train_config(max_steps=STEPS, eval_every=STEPS, eval_batches=4, guard=GuardConfig(**guard))


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _events(out: Path) -> list[tuple[int, str]]:
    return [(r["step"], r["type"]) for r in _log(out) if r["kind"] == "event"]


def _poison(trainer: Trainer, steps, how: str):
    """From inside the model: at the given optimizer steps (1-based) the embeddings become NaN, or
    the logits are scaled up 100x (a loss in the hundreds: a spike, with finite values)."""

    def nan_embeddings(module, args, output):
        if trainer.step + 1 in steps and torch.is_grad_enabled():
            return output * float("nan")

    def sharpen_logits(model, batch):
        if trainer.step + 1 not in steps:
            return next_token_loss(model, batch)
        inputs, targets = batch
        logits = model(inputs).float() * 100
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()), targets.numel()

    if how == "nan":
        trainer.model.tok_embeddings.register_forward_hook(nan_embeddings)
    else:
        trainer.loss_fn = sharpen_logits
    return trainer


@pytest.fixture(scope="module")
def clean(pack, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    summary = Trainer(MODEL, _cfg(), pack, out).fit()
    return summary, _log(out)


@pytest.mark.parametrize(
    "how, guard",
    [
        ("nan", {}),
        ("spike", {"spike_sigma": 6.0, "window": 8, "min_history": 4}),
    ],
)
def test_skip_drops_the_bad_step_and_the_run_tracks_the_clean_one(pack, tmp_path, clean, how, guard):
    clean_summary, clean_log = clean
    out = tmp_path / "guarded"
    trainer = _poison(Trainer(MODEL, _cfg(action="skip", **guard), pack, out), {BAD_STEP}, how)
    before = {}
    step = trainer.train_step

    def spy(micro_batches, **kwargs):
        if trainer.step + 1 == BAD_STEP:
            before.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
        stats = step(micro_batches, **kwargs)
        if trainer.step == BAD_STEP:  # the flagged step left every weight as it was
            assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
        return stats

    trainer.train_step = spy
    summary = trainer.fit()
    kind = "nan" if how == "nan" else "spike"
    assert _events(out) == [(BAD_STEP, kind), (BAD_STEP, "skip")]
    assert before, "the spy never saw the bad step"
    assert summary["steps"] == STEPS and summary["guard_events"] == 1
    flagged = next(r for r in _log(out) if r["kind"] == "event" and r["type"] == kind)
    assert flagged["action"] == "skip"
    if how == "nan":
        assert math.isnan(flagged["loss"])
    else:
        assert flagged["loss"] > 20 and flagged["sigma"] > 6 and flagged["loss"] > flagged["mean"] + 6 * flagged["std"]
    # Same data afterwards (the bad step consumed its batch), one update fewer: the curve stays
    # close to the clean run's.
    assert math.isfinite(summary["final_val_loss"])
    assert summary["final_val_loss"] == pytest.approx(clean_summary["final_val_loss"], rel=0.1)
    train = [r for r in _log(out) if r["kind"] == "train"]
    clean_train = [r for r in clean_log if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    # Before the bad step the two runs are the same run.
    assert [r["loss"] for r in train[: BAD_STEP - 1]] == [r["loss"] for r in clean_train[: BAD_STEP - 1]]
    assert train[-1]["tokens_seen"] == clean_train[-1]["tokens_seen"]


def test_without_the_guard_the_planted_nan_ruins_the_run(pack, tmp_path):
    # The control: what the guard prevents. NaN weights make every later loss NaN.
    out = tmp_path / "unguarded"
    summary = _poison(Trainer(MODEL, _cfg(action="off"), pack, out), {BAD_STEP}, "nan").fit()
    assert math.isnan(summary["final_val_loss"]) and _events(out) == []


def test_rollback_reloads_the_checkpoint_skips_the_window_and_lowers_lr(pack, tmp_path, clean, monkeypatch):
    clean_summary, _ = clean
    out = tmp_path / "rollback"
    cfg = _cfg(action="rollback", lr_factor=0.5)
    trainer = _poison(Trainer(MODEL, cfg, pack, out), {BAD_STEP}, "nan")
    after = {}

    def respond_and_look(trainer, event):
        trainer_module.respond.__wrapped__(trainer, event)
        after["weights"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        after["checkpoint"] = load_weights(out / "checkpoints" / "step-00000008")[1]
        after["adam_steps"] = {float(state["step"]) for state in trainer.optimizer.state.values()}
        after["loader"] = trainer.train_loader.state_dict()

    respond_and_look.__wrapped__ = trainer_module.respond
    monkeypatch.setattr(trainer_module, "respond", respond_and_look)
    summary = trainer.fit()

    events = [r for r in _log(out) if r["kind"] == "event"]
    assert [(r["step"], r["type"]) for r in events] == [
        (BAD_STEP, "nan"),
        (BAD_STEP, "rollback"),
        (BAD_STEP, "lr_lowered"),
    ]
    rollback = events[1]
    assert rollback["checkpoint"] == "step-00000008" and rollback["checkpoint_step"] == 8
    assert rollback["skipped_steps"] == 2 and rollback["skipped_micro_batches"] == 2
    assert rollback["skipped_tokens"] == 2 * 64 and events[2]["lr_scale"] == 0.5
    # Step 9's update is gone (step 10's never happened): the weights are step 8's again.
    for name, tensor in after["checkpoint"].items():
        assert torch.equal(after["weights"][name], tensor), name
    assert after["adam_steps"] == {8.0}  # the optimizer state is step 8's too
    # The loader was not rewound: the next batch is the one after the bad step's.
    loader = TokenLoader(pack, "train", seq_len=cfg.seq_len, batch_size=cfg.micro_batch_size, seed=cfg.seed)
    for _ in range(BAD_STEP):
        next(loader)
    assert after["loader"] == loader.state_dict()

    train = [r for r in _log(out) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train[BAD_STEP:]:
        assert r["lr"] == pytest.approx(0.5 * lr_at(r["step"] - 1, cfg))
    assert summary["steps"] == STEPS and summary["lr_scale"] == 0.5 and math.isfinite(summary["final_val_loss"])
    # Two updates fewer, then at half the learning rate: still close to the clean run.
    assert summary["final_val_loss"] == pytest.approx(clean_summary["final_val_loss"], rel=0.15)
    # The lowered learning rate and the guard's state are saved, and a resumed run keeps them.
    saved = torch.load(out / "checkpoints" / "step-00000020" / "train_state.pt", weights_only=True)
    assert saved["loop"]["lr_scale"] == 0.5 and saved["loop"]["guard"]["events"] == 1
    resumed = Trainer(MODEL, cfg, pack, out)
    assert resumed.step == STEPS and resumed.lr_scale == 0.5 and resumed.guard.events == 1
    assert len(resumed.guard.history) == STEPS - 1


def test_rollback_before_any_checkpoint_skips(pack, tmp_path):
    out = tmp_path / "early"
    summary = _poison(Trainer(MODEL, _cfg(action="rollback"), pack, out), {2}, "nan").fit()
    assert _events(out) == [(2, "nan"), (2, "skip")]
    skip = [r for r in _log(out) if r["kind"] == "event"][1]
    assert "no checkpoint" in skip["reason"] and math.isfinite(summary["final_val_loss"])


def test_a_diverging_run_stops_with_a_clear_error(pack, tmp_path):
    out = tmp_path / "diverged"
    trainer = _poison(Trainer(MODEL, _cfg(action="skip", max_events=2), pack, out), set(range(3, STEPS)), "nan")
    with pytest.raises(TrainingDiverged, match=r"step 5: .*train\.guard\.max_events=2"):
        trainer.fit()
    assert _events(out) == [(3, "nan"), (3, "skip"), (4, "nan"), (4, "skip"), (5, "nan")]


def test_fp16_overflow_is_left_to_the_grad_scaler(pack, tmp_path):
    trainer = Trainer(MODEL, dataclasses.replace(_cfg(), precision="fp16"), pack, tmp_path / "fp16")
    trainer.train_step([next(trainer.train_loader)])
    trainer.scaler.update(new_scale=2.0**60)  # a finite loss, but fp16 gradients that overflow
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    stats = trainer.train_step([next(trainer.train_loader)])
    assert math.isfinite(stats["loss"]) and not math.isfinite(stats["grad_norm"])
    assert stats["event"] is None and trainer.guard.events == 0 and len(trainer.guard.history) == 1
    assert trainer.scaler.get_scale() == 2.0**59  # the scaler skipped the step and backed off
    assert all(torch.equal(v, start[k]) for k, v in trainer.model.state_dict().items())
