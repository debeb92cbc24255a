"""Every numeric input has a range: NaN and infinity are refused for every float key of every config
(found by walking the dataclasses, so a new key is covered when it is added), each key's real range
is checked, every float flag of every verb refuses them, and sizes that cannot fit in memory are
refused with the estimate before anything is allocated."""

import dataclasses
import re
import shutil
import types
import typing
from pathlib import Path

import pytest
import torch

from kiln.checkpoint import save_weights
from kiln.cli import main
from kiln.config import build
from kiln.data.steps.base import STEPS
from kiln.errors import ConfigError
from kiln.infer.config import SampleConfig, SamplingParams
from kiln.infer.kv_cache import KVCache
from kiln.infer.load import InferenceOptions, load_for_inference
from kiln.infer.samples import sample_texts
from kiln.model import build_model
from kiln.model.config import ModelConfig
from kiln.model.transformer import position_table_bytes
from kiln.post.judge import JudgeConfig
from kiln.recipe import Recipe, load_recipe

ROOT = Path(__file__).resolve().parents[1]
NON_FINITE = ("nan", "inf", "-inf")


def _is_float(hint) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return float in typing.get_args(hint)
    return hint is float


def config_classes():
    """(dataclass, its section) of every config `build` fills: the recipe's tables and what they
    nest, every curation step's params, and the judge's table."""
    found = []

    def walk(cls, section):
        found.append((cls, section))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{section}.{f.name}" if section else f.name)

    walk(Recipe, "")
    for name, step in STEPS.items():
        walk(step, f"data.params.{name}")
    walk(JudgeConfig, "judge")
    return found


def float_keys():
    keys = []
    for cls, section in config_classes():
        hints = typing.get_type_hints(cls)
        keys += [(cls, section, f.name) for f in dataclasses.fields(cls) if _is_float(hints[f.name])]
    return keys


def test_the_walk_finds_the_configs():
    sections = {section for _, section in config_classes()}
    assert {"model", "train", "train.guard", "sample", "ppo.train", "peft", "judge"} <= sections
    assert "data.params.gopher_quality" in sections
    assert len(float_keys()) > 60


@pytest.mark.parametrize("text", NON_FINITE)
@pytest.mark.parametrize("cls, section, name", float_keys(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_float_key_refuses_non_finite(cls, section, name, text):
    value = float(text)
    with pytest.raises(ConfigError) as err:
        build(cls, {name: value}, section or "x")
    assert err.value.key == f"{section or 'x'}.{name}"
    assert err.value.message == f"must be a finite number, got {value}"


def valid_instance(cls, tmp_path):
    """An instance of `cls` that validates: its defaults, or for the two configs whose defaults
    cannot (they need a file or a rubric) a minimal valid one."""
    if cls is JudgeConfig:
        return JudgeConfig(rubric="be helpful", checkpoint="judge", policy="policy", prompts=["p.jsonl"])
    if cls is STEPS["quality_classifier"]:
        for name in ("clf.safetensors", "clf.json"):
            (tmp_path / name).write_bytes(b"")
        return cls(model_path=str(tmp_path / "clf.safetensors"))
    return cls()


@pytest.mark.parametrize("text", ["nan", "inf"])
@pytest.mark.parametrize("cls, section, name", float_keys(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_validate_refuses_non_finite_in_python(cls, section, name, text, tmp_path):
    """A config built in Python skips `build`; its validate() is written so NaN and inf fail too."""
    base = valid_instance(cls, tmp_path)
    base.validate()
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(base, **{name: float(text)}).validate()
    assert err.value.key == name


def test_a_float_list_and_table_refuse_non_finite_too():
    with pytest.raises(ConfigError, match=r"pack.mixture.python_stdlib: must be a finite number, got nan"):
        load_recipe(None, ["pack.mixture={python_stdlib=nan}"])


def refused(override: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_recipe(None, [override])
    return err.value


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=nan", "must be a finite number, got nan"),
        ("train.lr=inf", "must be a finite number, got inf"),
        ("train.eps=nan", "must be a finite number, got nan"),
        ("train.eps=-1", "must be a positive finite number, got -1.0"),
        ("train.eps=0", "must be a positive finite number, got 0.0"),
        ("train.weight_decay=inf", "must be a finite number, got inf"),
        ("model.init_std=nan", "must be a finite number, got nan"),
        ("model.init_std=0", "must be a positive finite number, got 0.0"),
        ("model.ffn_multiplier=nan", "must be a finite number, got nan"),
        ("model.ffn_multiplier=-1", "must be a positive finite number, got -1.0"),
        ("model.ffn_multiplier=0.001", "gives an FFN of width 0; it must be at least 1 unit wide"),
        ("model.norm_eps=nan", "must be a finite number, got nan"),
        ("model.norm_eps=-1e-5", "must be a positive finite number, got -1e-05"),
        ("model.rope_theta=inf", "must be a finite number, got inf"),
        ("model.rope_theta=1", "must be a finite number > 1, got 1.0"),
        ("sample.temperature=nan", "must be a finite number, got nan"),
        ("sft.train.weight_decay=-0.1", "must be a finite number >= 0, got -0.1"),
        ("sft.train.min_lr_ratio=2", "must be in [0, 1], got 2.0"),
        ("dpo.train.global_batch_tokens=-64", "must be >= 0 (0: one micro-batch per step), got -64"),
    ],
)
def test_listed_values_are_refused_naming_the_key(override, message):
    err = refused(override)
    assert (err.key, err.message) == (override.partition("=")[0], message)


@pytest.mark.parametrize(
    "cfg, key",
    [
        (ModelConfig(norm_eps=float("nan")), "norm_eps"),
        (ModelConfig(init_std=float("nan")), "init_std"),
        (ModelConfig(ffn_multiplier=float("nan")), "ffn_multiplier"),
        (ModelConfig(rope_theta=float("inf")), "rope_theta"),
        (ModelConfig(moe_aux_loss_weight=float("inf")), "moe_aux_loss_weight"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(temperature=float("inf")), "temperature"),
        (SamplingParams(repetition_penalty=float("nan")), "repetition_penalty"),
        (SamplingParams(top_p=float("nan")), "top_p"),
    ],
)
def test_configs_built_in_python_refuse_non_finite_in_validate(cfg, key):
    """The Python API skips `build`: validate's own checks are written so NaN fails them."""
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert err.value.key == key


def test_train_config_built_in_python_refuses_nan():
    from kiln.train.config import TrainConfig

    for key in ("lr", "eps", "weight_decay", "grad_clip"):
        with pytest.raises(ConfigError) as err:
            dataclasses.replace(TrainConfig(), **{key: float("nan")}).validate()
        assert err.value.key == key


def test_integer_keys_refuse_floats_and_name_the_integer_to_write():
    err = refused("model.max_seq_len=1e9")
    assert (err.key, err.message) == (
        "model.max_seq_len",
        "expected an integer, got the number 1000000000.0; write it as 1000000000",
    )
    for text in ("1.5", "nan", "inf"):
        err = refused(f"train.max_steps={text}")
        assert err.key == "train.max_steps" and err.message == f"expected an integer, got a number {float(text)!r}"


def test_pretrain_cli_refuses_nan_lr(capsys):
    assert main(["pretrain", "recipes/tiny.toml", "train.lr=nan"]) == 2
    assert (
        capsys.readouterr().err.strip() == "kiln: error: recipes/tiny.toml: train.lr: must be a finite number, got nan"
    )


@pytest.mark.parametrize("flag", ["--temperature", "--top-p"])
@pytest.mark.parametrize("text", NON_FINITE)
def test_generate_cli_refuses_non_finite_flags(capsys, flag, text):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "missing-checkpoint", f"{flag}={text}"])  # = so argparse reads "-inf" as a value
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"kiln generate: error: argument {flag}: must be a finite number, got {text!r}"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "ckpt", "--temperature", "nan"],
        ["eval", "ckpt", "--code-timeout", "inf"],
        ["chat", "ckpt", "--top-p", "nan"],
        ["plan", "--tokens", "inf"],
        ["report", "runs/x", "--price", "nan"],
    ],
)
def test_other_verbs_float_flags_refuse_non_finite(capsys, argv):
    with pytest.raises(SystemExit):
        main(argv)
    assert "must be a finite number" in capsys.readouterr().err.splitlines()[-1]


def test_no_float_flag_is_parsed_by_plain_float():
    """Every float flag goes through kiln.config.finite_float (float() accepts 'nan' and 'inf')."""
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "kiln").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"type=float\b", line)
    ]
    assert offenders == []


def test_max_seq_len_of_a_billion_is_refused_with_its_estimate_before_allocating():
    cfg = load_recipe(None, ["model.max_seq_len=1_000_000_000", "model.vocab_size=512"]).model
    with pytest.raises(ConfigError) as err:
        build_model(cfg)
    assert err.value.key == "max_seq_len"
    assert re.fullmatch(
        r"the position tables for max_seq_len=1000000000 would need 1,430\.5 GiB, "
        r"more than the [\d,.]+ GiB available on cpu",
        err.value.message,
    )


@pytest.mark.parametrize("pos", ["rope", "sinusoidal", "learned"])
def test_position_estimate_covers_the_tables_and_the_limit_is_exact(monkeypatch, pos):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=128, pos=pos)
    tables = {"rope": ("rope_cos", "rope_sin"), "sinusoidal": ("pos_table",), "learned": ()}[pos]
    model = build_model(cfg)
    kept = sum(getattr(model, name).nbytes for name in tables)
    kept += model.pos_embeddings.weight.nbytes if pos == "learned" else 0
    assert position_table_bytes(cfg) >= kept
    needed = position_table_bytes(cfg)
    monkeypatch.setattr("kiln.model.memory.available_bytes", lambda device: needed)
    build_model(cfg)
    monkeypatch.setattr("kiln.model.memory.available_bytes", lambda device: needed - 1)
    with pytest.raises(ConfigError, match="max_seq_len"):
        build_model(cfg)


@pytest.fixture(scope="module")
def long_context_checkpoint(tmp_path_factory, kiln_tokenizer):
    """A 2-layer checkpoint with a 4096-token context, its tokenizer beside it."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=kiln_tokenizer.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=4096
    )
    path = save_weights(tmp_path_factory.mktemp("long") / "ckpt", cfg, build_model(cfg).state_dict(), {"step": 0})
    shutil.copy(kiln_tokenizer.path, Path(path) / "tokenizer.json")
    return Path(path)


def test_generate_200000_samples_is_refused_with_the_kv_cache_estimate(long_context_checkpoint, capsys):
    # 200000 rows x 4002 slots x 2 layers x 2 kv heads x 16 x fp32, keys and values: ~382 GiB.
    argv = [
        "generate",
        long_context_checkpoint,
        "--device",
        "cpu",
        "--num-samples",
        "200000",
        "--max-new-tokens",
        "4000",
    ]
    assert main([str(a) for a in argv]) == 2
    # The loaded-checkpoint line comes first; the refusal is one line after it.
    loaded, err = capsys.readouterr().err.strip().split("\n")
    assert loaded.startswith("loaded checkpoint ")
    assert re.fullmatch(
        r"kiln: error: <command line>: --num-samples: the KV cache \(200000 samples x \d+ tokens\) and prefill "
        r"logits would need [\d,.]+ GiB, more than the [\d,.]+ GiB available on cpu",
        err,
    )


def test_kv_cache_estimate_is_what_the_engine_allocates_and_the_limit_is_exact(
    long_context_checkpoint, kiln_tokenizer, monkeypatch
):
    model, _ = load_for_inference(long_context_checkpoint, None, InferenceOptions(device="cpu"))
    cache = KVCache.for_model(model, 3, 50)
    assert KVCache.nbytes(model, 3, 50) == cache.k.nbytes + cache.v.nbytes
    cfg = SampleConfig(prompt="def ", max_new_tokens=4, num_samples=3)
    prompt_len = len(kiln_tokenizer.encode("def ")) + 1
    needed = KVCache.nbytes(model, 3, prompt_len + 3) + 3 * prompt_len * model.cfg.vocab_size * 4
    monkeypatch.setattr("kiln.model.memory.available_bytes", lambda device: needed)
    assert len(sample_texts(model, kiln_tokenizer, cfg)) == 3
    monkeypatch.setattr("kiln.model.memory.available_bytes", lambda device: needed - 1)
    with pytest.raises(ConfigError) as err:
        sample_texts(model, kiln_tokenizer, cfg)
    assert err.value.key == "num_samples"


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["eval", "nowhere", "--temperature=-1"],
            "--temperature: must be a finite number >= 0 (0 is greedy), got -1.0",
        ),
        (["eval", "nowhere", "--top-p", "2"], "--top-p: must be in (0, 1], got 2.0"),
        (["plan", "--preset", "tiny", "--tokens=-5e9"], "--tokens: must be >= 0 (0: no budget to price), got -5e+09"),
    ],
)
def test_other_verbs_check_the_range_of_float_flags(capsys, argv, line):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"kiln: error: {line}"
