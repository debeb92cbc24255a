import json
import math
from pathlib import Path

import pytest
import torch
from kiln_testing.train import tiny_train_config, train_step_capturing_grads

from kiln.checkpoint import complete_checkpoints
from kiln.errors import ConfigError
from kiln.model import ModelConfig
from kiln.model.weights import load_weights
from kiln.train.trainer import Trainer, next_token_loss

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


def _records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_loss_falls_and_outputs(pack, tmp_path, capsys):
    out = tmp_path / "run"
    summary = Trainer(MODEL, tiny_train_config(max_steps=40, eval_every=20, ckpt_every=20), pack, out).fit()
    train = _records(out, "train")
    assert [r["step"] for r in train] == list(range(1, 41))
    groups = {f"grad_norm/{g}" for g in ("embed", "attn", "mlp", "norm", "head")}  # untied: a head of its own
    assert {k for k in train[0] if not k.startswith("sys/")} == {
        "kind",
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "mfu",
        "hfu",
        "peak_mem_mb",
        "tokens_seen",
        "batch_tokens",
        *groups,
    }
    assert {"sys/cpu_percent", "sys/ram_mb", "sys/rss_mb"} <= set(train[0])
    assert all(r["batch_tokens"] == 64 and r["hfu"] == r["mfu"] for r in train)
    assert train[0]["loss"] == pytest.approx(math.log(64), abs=0.3)  # near uniform at init
    assert train[-1]["tokens_seen"] == 40 * 64
    val = _records(out, "val")
    assert [r["step"] for r in val] == [20, 40]
    assert val[-1]["val_loss"] < train[0]["loss"] - 1.5
    assert val[-1]["val_bpb"] == pytest.approx(val[-1]["val_loss"] / math.log(2) / 3.0)
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["final_val_loss"] == val[-1]["val_loss"]
    assert summary["best_step"] == 40 and summary["tokens_per_s"] > 0 and summary["mfu"] > 0
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-00000020", "step-00000040"]
    assert "step 40 | val loss" in capsys.readouterr().out
    model_cfg, state, manifest = load_weights(out)
    assert model_cfg.vocab_size == 64 and manifest["step"] == 40 and manifest["tokens_seen"] == 40 * 64


def test_group_grad_norms_add_up_to_the_global_norm(pack, tmp_path):
    out = tmp_path / "run"
    Trainer(MODEL, tiny_train_config(max_steps=3, log_every=2, grad_clip=0.01), pack, out).fit()
    train = _records(out, "train")
    assert [r["step"] for r in train] == [2, 3]
    for r in train:
        parts = [r[f"grad_norm/{g}"] for g in ("embed", "attn", "mlp", "norm", "head")]
        # Before clipping, like grad_norm: the clipped norm would be 0.01.
        assert math.sqrt(sum(v * v for v in parts)) == pytest.approx(r["grad_norm"], rel=1e-5)
        assert min(parts) > 0 and r["grad_norm"] > 0.1


def test_hfu_counts_the_recomputed_forward(pack, tmp_path):
    out = tmp_path / "run"
    summary = Trainer(MODEL, tiny_train_config(max_steps=3, activation_checkpointing="full"), pack, out).fit()
    for r in _records(out, "train"):
        assert r["hfu"] == pytest.approx(r["mfu"] * 4 / 3) and r["mfu"] > 0
    assert summary["hfu"] == pytest.approx(summary["mfu"] * 4 / 3)


def test_loggers_reach_the_metrics_logger(pack, tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    Trainer(MODEL, tiny_train_config(max_steps=3, loggers=["tensorboard"]), pack, out).fit()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    with pytest.raises(ConfigError, match="loggers"):
        tiny_train_config(loggers=["stdout"]).validate()


def _one_step(pack, out, cfg, batch, micro, loss_fn=None):
    """Gradients (as the optimizer sees them) and weights after one train_step on `batch`."""
    trainer = Trainer(MODEL, cfg, pack, out, resume="none", loss_fn=loss_fn)
    x, y = batch
    _, grads = train_step_capturing_grads(
        trainer, [(x[i : i + micro], y[i : i + micro]) for i in range(0, len(x), micro)]
    )
    return grads, trainer.model.state_dict()


def _batch(n=8, seq=16):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (n, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_gradient_accumulation_matches_big_batch(pack, tmp_path):
    batch = _batch()
    big, _ = _one_step(pack, tmp_path / "a", tiny_train_config(micro_batch_size=8, global_batch_tokens=128), batch, 8)
    accumulated, _ = _one_step(
        pack, tmp_path / "b", tiny_train_config(micro_batch_size=4, global_batch_tokens=128), batch, 4
    )
    for name in big:
        torch.testing.assert_close(accumulated[name], big[name], rtol=1e-4, atol=1e-7)
        assert big[name].abs().max() > 0, name
    trainer = Trainer(
        MODEL, tiny_train_config(micro_batch_size=4, global_batch_tokens=128), pack, tmp_path / "c", resume="none"
    )
    assert trainer.accum_steps == 2


def masked_loss(model, batch):
    """Counts only targets of even value: micro-batches then hold different numbers of tokens."""
    inputs, targets = batch
    targets = torch.where(targets % 2 == 0, targets, torch.full_like(targets, -100))
    logits = model(inputs).float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return loss, int((targets != -100).sum())


def test_accumulation_weights_uneven_micro_batches_by_tokens(pack, tmp_path):
    x, y = _batch()
    y = y.clone()
    y[:4] = 2 * (y[:4] // 2)  # first half: every target counted; second half: about half of them
    big, _ = _one_step(
        pack,
        tmp_path / "a",
        tiny_train_config(micro_batch_size=8, global_batch_tokens=128),
        (x, y),
        8,
        loss_fn=masked_loss,
    )
    accumulated, _ = _one_step(
        pack,
        tmp_path / "b",
        tiny_train_config(micro_batch_size=4, global_batch_tokens=128),
        (x, y),
        4,
        loss_fn=masked_loss,
    )
    for name in big:
        torch.testing.assert_close(accumulated[name], big[name], rtol=1e-4, atol=1e-7)


def test_activation_checkpointing_gives_same_step(pack, tmp_path):
    batch = _batch(4)
    _, plain = _one_step(pack, tmp_path / "a", tiny_train_config(), batch, 4)
    _, recomputed = _one_step(pack, tmp_path / "b", tiny_train_config(activation_checkpointing="full"), batch, 4)
    for name in plain:
        assert torch.equal(plain[name], recomputed[name]), name


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains(pack, tmp_path, precision):
    out = tmp_path / precision
    trainer = Trainer(
        MODEL, tiny_train_config(precision=precision, max_steps=12, eval_every=12, ckpt_every=12), pack, out
    )
    assert trainer.scaler.is_enabled() == (precision == "fp16")
    summary = trainer.fit()
    losses = [r["loss"] for r in _records(out, "train")]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.5
    assert math.isfinite(summary["final_val_loss"])
    # master weights stay fp32 under autocast
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    train_state = torch.load(out / "checkpoints" / "step-00000012" / "train_state.pt", weights_only=True)
    if precision == "fp16":
        assert train_state["scaler"]["scale"] > 0
    else:
        assert train_state["scaler"] == {}


def test_fp16_loss_scaler_skips_overflowing_step(pack, tmp_path):
    trainer = Trainer(MODEL, tiny_train_config(precision="fp16"), pack, tmp_path / "run")
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    scale = trainer.scaler.get_scale()

    def overflowing(model, batch):
        loss, n_tokens = next_token_loss(model, batch)
        return loss * float("inf"), n_tokens

    trainer.loss_fn = overflowing
    trainer.train_step([_batch(4)])
    assert all(torch.equal(v, start[k]) for k, v in trainer.model.state_dict().items())
    assert trainer.scaler.get_scale() == scale / 2  # backed off, step skipped
    trainer.loss_fn = next_token_loss
    trainer.train_step([_batch(4)])
    assert not torch.equal(trainer.model.layers[0].attn.wqkv.weight, start["layers.0.attn.wqkv.weight"])
    assert trainer.scaler.get_scale() == scale / 2


@pytest.mark.parametrize("optimizer", ["lion", "adafactor"])
def test_other_optimizers_train(pack, tmp_path, optimizer):
    # Lion takes unit-size steps, so a smaller lr; Adafactor's lr caps a step relative to the weight RMS.
    lr = {"lion": 3e-3, "adafactor": 0.1}[optimizer]
    out = tmp_path / optimizer
    Trainer(
        MODEL, tiny_train_config(optimizer=optimizer, lr=lr, max_steps=12, eval_every=12, ckpt_every=12), pack, out
    ).fit()
    losses = [r["loss"] for r in _records(out, "train")]
    assert losses[-1] < losses[0] - 0.5


def test_early_stopping_and_best_checkpoint(pack, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(
        MODEL,
        tiny_train_config(max_steps=20, eval_every=1, ckpt_every=100, keep_last=1, early_stop_patience=2),
        pack,
        out,
    )
    scripted = iter([3.0, 2.5, 2.6, 2.7, 1.0])
    trainer.evaluate = lambda: {
        "val_loss": (v := next(scripted)),
        "val_bpb": v / math.log(2) / 3.0,
        "val_tokens": 64,
        "val_sequences": 4,
    }
    summary = trainer.fit()
    assert summary["stopped_early"] and summary["steps"] == 4
    assert summary["best_step"] == 2 and summary["best_val_loss"] == 2.5 and summary["final_val_loss"] == 2.7
    root = out / "checkpoints"
    assert (root / "best").read_text().strip() == "step-00000002"
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000002", "step-00000004"]
    assert json.loads((root / "step-00000002" / "manifest.json").read_text())["val_loss"] == 2.5


def test_init_from_loads_weights_only(pack, tmp_path):
    first = tmp_path / "first"
    Trainer(MODEL, tiny_train_config(max_steps=4), pack, first).fit()
    _, weights, _ = load_weights(first)
    second = Trainer(MODEL, tiny_train_config(max_steps=4, seed=7), pack, tmp_path / "second", init_from=first)
    assert second.step == 0 and second.resumed_from is None
    for name, tensor in second.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    wrong = ModelConfig(dim=64, n_layers=2, n_heads=4, max_seq_len=32)
    with pytest.raises(ConfigError, match="init_from"):
        Trainer(wrong, tiny_train_config(), pack, tmp_path / "third", init_from=first)


def test_resume_none_refuses_to_mix_runs(pack, tmp_path):
    Trainer(MODEL, tiny_train_config(max_steps=4), pack, tmp_path / "run").fit()
    with pytest.raises(ConfigError, match="resume"):
        Trainer(MODEL, tiny_train_config(max_steps=4), pack, tmp_path / "run", resume="none")


def test_config_errors_name_the_key(pack, tmp_path):
    with pytest.raises(ConfigError, match="seq_len"):
        Trainer(MODEL, tiny_train_config(seq_len=64, global_batch_tokens=256), pack, tmp_path / "a")
    with pytest.raises(ConfigError, match="vocab_size"):
        Trainer(
            ModelConfig(vocab_size=32, dim=32, n_layers=1, n_heads=4, max_seq_len=32),
            tiny_train_config(),
            pack,
            tmp_path / "b",
        )


def test_default_loss_is_mean_cross_entropy():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    loss, n = next_token_loss(lambda x: logits, (None, targets))
    assert n == 6
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits.view(6, 5), targets.view(6)).item())


def test_auto_resume_skips_corrupted_checkpoint(pack, tmp_path):
    out = tmp_path / "run"
    Trainer(MODEL, tiny_train_config(eval_every=100), pack, out).fit()
    # Cloned: safetensors maps the file, and the next lines overwrite it in place.
    original = {k: v.clone() for k, v in load_weights(out)[1].items()}
    corrupted = out / "checkpoints" / "step-00000008" / "model.safetensors"
    data = bytearray(corrupted.read_bytes())
    data[-10] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    with pytest.warns(UserWarning) as warned:
        trainer = Trainer(MODEL, tiny_train_config(eval_every=100), pack, out)
    messages = " ".join(str(w.message) for w in warned)
    assert "skipping checkpoint step-00000008" in messages and "model.safetensors" in messages
    assert "moved to damaged/step-00000008" in messages  # quarantined, not left as a newer step folder
    assert trainer.step == 4 and trainer.resumed_from.endswith("step-00000004")
    assert (out / "checkpoints" / "damaged" / "step-00000008").is_dir()
    trainer.fit()
    _, redone, manifest = load_weights(out)
    assert manifest["step"] == 8
    for name, tensor in original.items():
        assert torch.equal(redone[name], tensor), name
