"""`[model] arch` in a recipe: "t5" fills a T5Config, an unknown family is refused by name, and what a
T5 run cannot do yet is refused by key before anything runs."""

import pytest

from kiln.cli import main
from kiln.errors import ConfigError
from kiln.model.t5_config import T5Config
from kiln.recipe import load_recipe


def test_tiny_t5_recipe_is_a_t5():
    recipe = load_recipe("recipes/tiny-t5.toml")
    assert isinstance(recipe.model, T5Config) and recipe.tokenizer.sentinels == 100


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.arch=gpt", "model.arch: unknown model family 'gpt'; known: decoder, bert, t5"),
        ("model.pos=rope", "model.pos: unknown key"),
        ("parallel.tp=2", "parallel.tp: must be 1"),
        ("train.activation_checkpointing=true", "train.activation_checkpointing"),
    ],
)
def test_what_t5_cannot_do_is_refused_by_key(override, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        load_recipe("recipes/tiny-t5.toml", [override])


def test_post_training_and_plan_refuse_a_t5(capsys, tmp_path):
    assert main(["run", "recipes/tiny-t5.toml", f'run.out_dir="{tmp_path}"', 'run.stages=["pretrain", "sft"]']) == 2
    assert "run.stages: sft need a decoder; model.arch = 't5'" in capsys.readouterr().err
    assert main(["plan", "recipes/tiny-t5.toml"]) == 2
    assert "model.arch: `kiln plan` lays out decoder models" in capsys.readouterr().err
