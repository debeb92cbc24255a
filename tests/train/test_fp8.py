"""fp8 training through torchao's Float8Linear, on CPU (torch._scaled_mm has a CPU kernel with the
GPU's float8 numerics). Bands, from tests below and docs/fp8.md:
- a converted block linear under bf16 autocast is within 8% (relative Frobenius error) of the fp32
  matmul, and at least 4x further from it than the bf16 matmul (float8 e4m3 keeps 3 mantissa bits,
  bf16 7), so a linear that silently stayed bf16 fails;
- a tiny model trained with fp8 follows the bf16 run from the same seed within 0.02 nats at every
  step (measured: 0.002 over 12 steps), and not bit for bit (an unconverted model would be)."""

import json
import math
from pathlib import Path

import pytest
import torch
from kiln_testing.recipes import pretrain_only_recipe
from kiln_testing.train import tiny_train_config

float8 = pytest.importorskip("torchao.float8")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from kiln.cli import main  # noqa: E402
from kiln.errors import ConfigError  # noqa: E402
from kiln.model import ModelConfig, build_model  # noqa: E402
from kiln.peft.load import load_model  # noqa: E402
from kiln.train import trainer as trainer_module  # noqa: E402
from kiln.train.precision import autocast, convert_to_fp8, fp8_linears  # noqa: E402
from kiln.train.trainer import Trainer  # noqa: E402

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, vocab_size=64)
BLOCK_LINEARS = 5  # wqkv, wo, w1, w3, w2
GRANULARITY = {"tensorwise": ScalingGranularity.TENSORWISE, "rowwise": ScalingGranularity.AXISWISE}


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


def _losses(out: Path) -> list[float]:
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_swaps_block_linears_keeps_head_and_state(recipe):
    model = build_model(ModelConfig(**{**MODEL.__dict__, "dim": 64}))
    before = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    converted, left_out = convert_to_fp8(model, recipe)
    assert converted == fp8_linears(model) == MODEL.n_layers * BLOCK_LINEARS and left_out == []
    assert type(model.output) is torch.nn.Linear  # the head stays high precision
    for m in model.modules():
        if isinstance(m, Float8Linear):
            assert m.config.cast_config_input.scaling_granularity is GRANULARITY[recipe]
    assert {k: (v.shape, v.dtype) for k, v in model.state_dict().items()} == before


def test_linears_with_dims_not_divisible_by_16_stay_bf16():
    # ffn_hidden 40: wqkv (64 x 32) and wo (32 x 32) convert, w1 and w3 (40 x 32) and w2 (32 x 40) do not.
    model = build_model(ModelConfig(**{**MODEL.__dict__, "ffn_hidden": 40}))
    converted, left_out = convert_to_fp8(model)
    assert left_out == [f"layers.{i}.ffn.{w}" for i in range(MODEL.n_layers) for w in ("w1", "w3", "w2")]
    assert converted == MODEL.n_layers * (BLOCK_LINEARS - 3)
    with pytest.raises(ConfigError, match="^precision: fp8 found no block linear with both dims divisible by 16"):
        convert_to_fp8(build_model(ModelConfig(**{**MODEL.__dict__, "dim": 40, "ffn_hidden": 40})))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_forward_close_to_bf16(recipe):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**MODEL.__dict__, "dim": 128}))
    reference = model.layers[0].attn.wqkv
    weight = reference.weight.detach().clone()
    convert_to_fp8(model, recipe)
    fp8 = model.layers[0].attn.wqkv
    x = torch.randn(64, 128)
    exact = x @ weight.T
    with torch.no_grad(), autocast("bf16"):
        bf16 = reference(x).float()
    with torch.no_grad(), autocast("fp8"):
        out = fp8(x)
    assert out.dtype == torch.bfloat16
    err = lambda y: float((y.float() - exact).norm() / exact.norm())  # noqa: E731
    assert err(out) < 0.08
    assert err(out) > 4 * err(bf16)


def test_fp8_loss_tracks_bf16(pack, tmp_path):
    """Same seed, same data: fp8 and bf16 runs of a tiny model stay within the band."""
    runs = {}
    for precision in ("bf16", "fp8"):
        cfg = tiny_train_config(precision=precision, max_steps=4, lr=3e-3, eval_every=100, ckpt_every=100)
        trainer = Trainer(MODEL, cfg, pack, tmp_path / precision)
        summary = trainer.fit()
        runs[precision] = _losses(tmp_path / precision)
        assert summary["fp8_linears"] == fp8_linears(trainer.model)
    assert summary["fp8_linears"] == MODEL.n_layers * BLOCK_LINEARS
    bf16, fp8 = runs["bf16"], runs["fp8"]
    assert len(fp8) == len(bf16) == 4 and all(math.isfinite(v) for v in fp8)
    assert max(abs(a - b) for a, b in zip(fp8, bf16)) < 0.02
    assert fp8 != bf16  # an unconverted model trains bit for bit like bf16


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_loss_tracks_bf16_over_longer_run(pack, tmp_path, recipe):
    runs = {}
    for precision, fp8_recipe in (("bf16", ""), ("fp8", recipe)):
        cfg = tiny_train_config(
            precision=precision, fp8_recipe=fp8_recipe, max_steps=30, lr=3e-3, eval_every=100, ckpt_every=100
        )
        runs[precision] = (Trainer(MODEL, cfg, pack, tmp_path / precision).fit(), _losses(tmp_path / precision))
    (bf16_summary, bf16), (fp8_summary, fp8) = runs["bf16"], runs["fp8"]
    assert max(abs(a - b) for a, b in zip(fp8, bf16)) < 0.02 and fp8 != bf16
    assert abs(fp8_summary["final_val_loss"] - bf16_summary["final_val_loss"]) < 0.02


def test_fp8_checkpoint_loads_as_a_plain_model(pack, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(MODEL, tiny_train_config(precision="fp8", max_steps=2, warmup_steps=0, ckpt_every=2), pack, out)
    trainer.fit()
    model, manifest = load_model(out / "checkpoints")
    assert manifest["step"] == 2 and fp8_linears(model) == 0
    trained = trainer.model.state_dict()
    assert set(model.state_dict()) == set(trained)
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, trained[name]), name


def test_recipe_keys_reach_the_trainer_from_kiln_pretrain(tmp_path, tiny_pack_factory, monkeypatch):
    recipe, stage = pretrain_only_recipe(tmp_path, tiny_pack_factory)
    seen = []

    def recording(model, fp8_recipe):
        seen.append(fp8_recipe)
        return convert_to_fp8(model, fp8_recipe)

    monkeypatch.setattr(trainer_module, "convert_to_fp8", recording)
    overrides = ["train.precision=fp8", "train.fp8_recipe=rowwise", "train.max_steps=2", "train.warmup_steps=0"]
    overrides.append("train.eval_batches=1")  # float8 matmuls on CPU are slow: a small validation
    assert main(["pretrain", str(recipe), *overrides]) == 0
    assert seen == ["rowwise"]
    summary = json.loads((stage / "summary.json").read_text())
    assert summary["precision"] == "fp8" and summary["fp8_linears"] == 2 * BLOCK_LINEARS
