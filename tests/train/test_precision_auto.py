"""train.precision = "auto": bf16 where this device's bf16 matmuls are faster, else fp32; an explicit
bf16 on a CPU without bf16 kernels warns. The CPU rates are faked, so every machine kind is tested
on whichever machine runs the suite."""

import json

import pytest
import torch
from kiln_testing.train import tiny_train_config

from kiln.model import ModelConfig
from kiln.recipe import load_recipe
from kiln.train import precision as precision_module
from kiln.train.precision import autocast, resolve_precision
from kiln.train.trainer import Trainer

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
GFLOP = 1e9


@pytest.fixture
def cpu_rates(monkeypatch):
    """Set (fp32, bf16) matmul FLOP/s the resolution sees; its cache is cleared around the test."""

    def set_rates(fp32: float, bf16: float):
        monkeypatch.setattr(precision_module, "cpu_bf16_speedup", lambda: (fp32, bf16))
        precision_module._resolve.cache_clear()

    yield set_rates
    precision_module._resolve.cache_clear()


@pytest.mark.parametrize(
    "fp32, bf16, chosen",
    [
        (69 * GFLOP, 0.9 * GFLOP, "fp32"),  # AVX2 only (Zen 3): bf16 through the reference loop
        (180 * GFLOP, 410 * GFLOP, "bf16"),  # AVX512_BF16 (Zen 4): ~2.2x
        (424 * GFLOP, 2571 * GFLOP, "bf16"),  # AMX: ~6x
        (100 * GFLOP, 110 * GFLOP, "fp32"),  # below the 1.2x bar: not worth bf16's rounding
    ],
)
def test_auto_on_cpu_follows_the_measured_rates(cpu_rates, fp32, bf16, chosen):
    cpu_rates(fp32, bf16)
    got, note = resolve_precision("auto", "cpu")
    assert got == chosen
    assert note.startswith(f"note: train.precision = auto: {chosen} on this CPU") and "GFLOP/s" in note


def test_explicit_bf16_is_kept_and_warned_about_where_it_crawls(cpu_rates):
    cpu_rates(69 * GFLOP, 0.9 * GFLOP)
    got, note = resolve_precision("bf16", "cpu")
    assert got == "bf16" and note.startswith('warning: train.precision = "bf16" on this CPU') and "0.9 GFLOP/s" in note
    cpu_rates(180 * GFLOP, 410 * GFLOP)
    assert resolve_precision("bf16", "cpu") == ("bf16", None)
    assert resolve_precision("fp32", "cpu") == ("fp32", None)


def test_autocast_of_auto_is_that_of_the_resolved_precision(cpu_rates):
    cpu_rates(69 * GFLOP, 0.9 * GFLOP)
    with autocast("auto", "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    cpu_rates(180 * GFLOP, 410 * GFLOP)
    with autocast("auto", "cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_the_real_probe_measures_both_dtypes():
    precision_module.cpu_bf16_speedup.cache_clear()
    fp32, bf16 = precision_module.cpu_bf16_speedup()
    assert fp32 > 0 and bf16 > 0


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


@pytest.mark.parametrize("fp32, bf16, chosen", [(69 * GFLOP, 0.9 * GFLOP, "fp32"), (180 * GFLOP, 410 * GFLOP, "bf16")])
def test_trainer_trains_in_the_resolved_precision(cpu_rates, pack, tmp_path, capsys, fp32, bf16, chosen):
    cpu_rates(fp32, bf16)
    trainer = Trainer(
        MODEL,
        tiny_train_config(precision="auto", max_steps=2, warmup_steps=1, eval_every=2, ckpt_every=2),
        pack,
        tmp_path / "r",
    )
    assert trainer.cfg.precision == chosen
    assert trainer.compute_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[chosen]
    summary = trainer.fit()
    assert summary["precision"] == chosen
    assert f"train.precision = auto: {chosen}" in capsys.readouterr().err
    manifest = json.loads(next((tmp_path / "r" / "checkpoints").glob("step-*/manifest.json")).read_text())
    assert manifest["train_config"]["precision"] == chosen


def test_auto_is_the_default_and_the_shipped_recipes_use_it():
    assert load_recipe(None, []).train.precision == "auto"
    for name in ("tiny", "data-demo", "chat", "post-demo", "crawl-demo", "context-extension"):
        assert load_recipe(name, []).train.precision == "auto", name
