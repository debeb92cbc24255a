from pathlib import Path

import pytest

from kiln.config import parse_override
from kiln.errors import ConfigError
from kiln.recipe import Recipe, load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def write(tmp_path, text):
    path = tmp_path / "r.toml"
    path.write_text(text)
    return path


def test_shipped_recipes_load():
    for path in RECIPES.glob("*.toml"):
        assert isinstance(load_recipe(path), Recipe)


def test_defaults_are_valid():
    load_recipe(None).validate()


def test_preset_then_keys_override(tmp_path):
    r = load_recipe(write(tmp_path, '[model]\npreset = "125m"\nn_layers = 2\n'))
    assert (r.model.dim, r.model.n_layers, r.model.preset) == (768, 2, "125m")


def test_dotted_overrides_parse_toml_values(tmp_path):
    r = load_recipe(
        write(tmp_path, "[train]\nlr = 1e-3\n"),
        ["train.lr=3e-4", "model.preset=tiny", "train.compile=true", 'corpus.sources=["python_docs"]'],
    )
    assert r.train.lr == 3e-4 and r.model.preset == "tiny" and r.train.compile is True
    assert r.corpus.sources == ["python_docs"]


def test_int_accepted_for_float_but_not_reverse(tmp_path):
    assert load_recipe(None, ["train.lr=1"]).train.lr == 1.0
    with pytest.raises(ConfigError, match=r"train.max_steps: expected an integer"):
        load_recipe(None, ["train.max_steps=1.5"])


def test_mixture_table(tmp_path):
    r = load_recipe(write(tmp_path, "[pack.mixture]\npython_stdlib = 2\ndebian_docs = 1\n"))
    assert r.pack.mixture == {"python_stdlib": 2.0, "debian_docs": 1.0}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[model]\nn_heads = 5\n", r"r.toml: model.n_heads: must divide dim=256"),
        ("[model]\nn_kv_heads = 3\n", r"r.toml: model.n_kv_heads: must divide n_heads=4"),
        ("[model]\nwidth = 3\n", r"r.toml: model.width: unknown key"),
        ("[modle]\ndim = 3\n", r"r.toml: modle: unknown section"),
        ('[train]\nlr = "fast"\n', r"r.toml: train.lr: expected a number, got a string"),
        ("[train]\ncompile = 1\n", r"r.toml: train.compile: expected true or false"),
        ('[train]\nprecision = "fp4"\n', r"r.toml: train.precision: must be one of auto, fp32, bf16, fp16, fp8"),
        ("[train]\nglobal_batch_tokens = 1000\n", r"r.toml: train.global_batch_tokens: must be a multiple"),
        ('[model]\npreset = "huge"\n', r"r.toml: model.preset: unknown preset 'huge'"),
        ('[corpus]\nsources = ["web"]\n', r"r.toml: corpus.sources: unknown source 'web'"),
        ("[pack.mixture]\npython_stdlib = -1\n", r"r.toml: pack.mixture.python_stdlib: must be >= 0"),
        ('[run]\nstages = ["fly"]\n', r"r.toml: run.stages: unknown stage 'fly'"),
        ("[train\n", r"r.toml: recipe: invalid TOML"),
    ],
)
def test_bad_recipes_name_key_and_file(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected) as info:
        load_recipe(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_bad_override_names_key():
    with pytest.raises(ConfigError, match=r"train.warmup_steps: must be -1 \(derived\) or in \[0, max_steps=10\)"):
        load_recipe(None, ["train.max_steps=10", "train.warmup_steps=10"])
    with pytest.raises(ConfigError, match="override must look like"):
        parse_override("lr=3")


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml: recipe: file not found"):
        load_recipe(tmp_path / "nope.toml")


def test_nested_dataclass_tables_are_typed():
    from dataclasses import dataclass, field

    from kiln.config import build

    @dataclass
    class Inner:
        threshold: float = 0.5

    @dataclass
    class Outer:
        inner: Inner = field(default_factory=Inner)

    assert build(Outer, {"inner": {"threshold": 1}}, "x").inner.threshold == 1.0
    with pytest.raises(ConfigError, match=r"x.inner.limit: unknown key"):
        build(Outer, {"inner": {"limit": 1}}, "x")


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            '[data]\nsteps = ["gopher_quality"]\n[data.params.gopher_quality]\nmin_doc_words = "many"\n',
            r"r.toml: data.params.gopher_quality.min_doc_words: expected an integer",
        ),
        ('[data]\nsteps = ["shiny_filter"]\n', r"r.toml: data.steps: unknown step 'shiny_filter'"),
        (
            '[data]\nsteps = ["pii"]\n[data.params.langid]\nmin_score = 0.5\n',
            r"r.toml: data.params.langid: configures a step that is not in steps",
        ),
        (
            '[data]\nsteps = ["minhash_dedup"]\n[data.params.minhash_dedup]\nbands = 10\n',
            r"r.toml: data.params.minhash_dedup.bands: ",
        ),
        ('[data]\nexecutor = "spark"\n', r"r.toml: data.executor: must be one of local, ray"),
    ],
)
def test_bad_data_steps_name_the_key(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_recipe(write(tmp_path, text))


def test_data_step_params_reach_the_step(tmp_path):
    r = load_recipe(
        write(
            tmp_path,
            '[data]\nsteps = ["gopher_quality"]\n'
            '[data.params.gopher_quality]\nmin_doc_words = 7\nonly_sources = ["web"]\n',
        )
    )
    (step,) = r.data.build_steps()
    assert (step.min_doc_words, step.only_sources) == (7, ["web"])


def test_nested_table_keeps_the_enclosing_defaults():
    from kiln.recipe import load_recipe

    recipe = load_recipe(None, ["dpo.train.max_steps=40"])
    assert recipe.dpo.train.max_steps == 40
    # DPO's own fine-tuning defaults survive a partial [dpo.train] override.
    assert recipe.dpo.train.lr == load_recipe(None).dpo.train.lr != load_recipe(None).sft.train.lr


# Where Muon was measured against AdamW on the recipe's own model and data (docs/benchmarks.md):
# tiny and chat over three seeds with their post stages, data-demo on one seed (tiny's model),
# tiny-t5, tiny-bert (lr tuned for each optimizer), crawl-demo and continual (A and B) over three seeds,
# post-demo over three seeds of its SFT.
MUON_RECIPES = {"tiny", "data-demo", "chat", "tiny-t5", "tiny-bert", "crawl-demo", "continual", "post-demo"}


@pytest.mark.parametrize(
    "name",
    ["tiny", "data-demo", "chat", "tiny-t5", "tiny-bert", "crawl-demo", "post-demo", "continual", "context-extension"],
)
def test_recipes_pretrain_with_the_optimizer_measured_for_them(name):
    train = load_recipe(f"recipes/{name}.toml").train
    if name in MUON_RECIPES:
        assert (train.optimizer, train.muon_adjust_lr) == ("muon", "match_rms_adamw")
    else:
        assert train.optimizer == "adamw"
