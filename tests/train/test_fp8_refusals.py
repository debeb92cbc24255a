"""fp8 training's refusals: each a one-line ConfigError naming its key. None of these needs torchao
(tests/train/test_fp8.py has the numerics, which do)."""

import sys
from types import SimpleNamespace

import pytest
import torch
from kiln_testing.train import tiny_train_config

from kiln.errors import ConfigError
from kiln.model import ModelConfig, build_model
from kiln.peft.lora import LoRAConfig, apply_lora
from kiln.recipe import load_recipe
from kiln.train import precision
from kiln.train.precision import check_fp8_device, convert_to_fp8, fp8_device_problem
from kiln.train.trainer import Trainer

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, vocab_size=64)


@pytest.mark.parametrize(
    "device_type, capability, refused",
    [
        ("cuda", (8, 0), "compute capability >= 8.9 (Ada, Hopper or newer); this one has 8.0"),  # A100
        ("cuda", (8, 6), "this one has 8.6"),
        ("cuda", (8, 9), None),  # L4 / RTX 4090
        ("cuda", (9, 0), None),  # H100 / H200
        ("cuda", (10, 0), None),
        ("cpu", None, None),
        ("mps", None, "not on 'mps'"),
    ],
)
def test_fp8_device_check(device_type, capability, refused):
    problem = fp8_device_problem(device_type, capability)
    if refused is None:
        assert problem is None
    else:
        assert refused in problem


def test_check_fp8_device_reads_the_gpu_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ConfigError, match=r"^precision: fp8 needs a GPU of compute capability >= 8.9.*has 7.5$"):
        check_fp8_device(torch.device("cuda"))


def test_trainer_refuses_fp8_on_a_device_without_it(tmp_path, tiny_pack_factory, monkeypatch):
    monkeypatch.setattr(precision, "fp8_device_problem", lambda *a: "no fp8 on this device")
    pack = tiny_pack_factory(tmp_path / "pack")
    with pytest.raises(ConfigError, match="^precision: no fp8 on this device$"):
        Trainer(MODEL, tiny_train_config(precision="fp8"), pack, tmp_path / "run")


def test_fp8_refuses_tensor_parallelism():
    trainer = SimpleNamespace(device=torch.device("cpu"), layout=SimpleNamespace(dims=SimpleNamespace(tp=2)))
    with pytest.raises(ConfigError, match=r"^parallel.tp: tensor parallelism is not combined"):
        Trainer._check_fp8_layout(trainer)


def test_fp8_without_torchao_names_the_extra(monkeypatch):
    for name in ("torchao", "torchao.float8", "torchao.float8.float8_linear"):
        monkeypatch.setitem(sys.modules, name, None)  # import of a None entry raises ImportError
    with pytest.raises(ConfigError, match=r"^precision: fp8 needs the `torchao` package \(pip install 'kiln\[fp8\]'"):
        convert_to_fp8(build_model(MODEL))


def test_fp8_refuses_moe_experts():
    model = build_model(ModelConfig(**{**MODEL.__dict__, "moe_every": 1, "n_experts": 4}))
    with pytest.raises(ConfigError, match=r"^precision: fp8 does not cover MoE expert weights"):
        convert_to_fp8(model)


def test_fp8_refuses_lora():
    model = apply_lora(build_model(MODEL), LoRAConfig(r=4))
    with pytest.raises(ConfigError, match=r"^precision: fp8 trains full weights; LoRA, QLoRA and adapters"):
        convert_to_fp8(model)


def test_fp8_recipe_needs_fp8_precision(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[train]\nprecision = "bf16"\nfp8_recipe = "rowwise"\n')
    with pytest.raises(
        ConfigError, match=r"train.fp8_recipe: applies only with precision = \"fp8\", got precision = 'bf16'"
    ):
        load_recipe(recipe, [])
    with pytest.raises(ConfigError, match=r"^fp8_recipe: must be one of tensorwise, rowwise, got 'blockwise'$"):
        tiny_train_config(precision="fp8", fp8_recipe="blockwise").validate()
    tiny_train_config(precision="fp8", fp8_recipe="rowwise").validate()
    tiny_train_config(precision="fp8").validate()
