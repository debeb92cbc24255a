"""The post-training configs (kiln/post/config.py): torch-free, validated, and each stage's [<stage>.train]
table inheriting from [train] only what it does not set."""

import subprocess
import sys

import pytest

from kiln.errors import ConfigError
from kiln.post import config, losses
from kiln.post.config import DPOConfig
from kiln.recipe import load_recipe


def test_dpo_config_rejects_unknown_pair_sources():
    with pytest.raises(ConfigError, match="rejected"):
        DPOConfig(rejected="sampled").validate()
    with pytest.raises(ConfigError, match="rejected"):
        DPOConfig(rejected="policy", files=["pairs.jsonl"]).validate()
    with pytest.raises(ConfigError, match="nll_weight"):
        DPOConfig(nll_weight=-1.0).validate()


def test_stage_compile_inherits_train_compile_unless_the_stage_sets_it():
    recipe = load_recipe("recipes/tiny.toml")  # compiles pretraining, not its post stages
    assert recipe.train.compile is True
    assert recipe.sft.train.train_config(recipe.train).compile is False
    assert recipe.grpo.train.train_config(recipe.train).compile is False
    # Unset in the stage's table: [train]'s value.
    assert recipe.dpo.train.compile is None and recipe.dpo.train.train_config(recipe.train).compile is True
    again = load_recipe("recipes/tiny.toml", ["dpo.train.compile=false"])
    assert again.dpo.train.train_config(again.train).compile is False


def test_stage_optimizer_is_adamw_unless_the_stage_names_one():
    # post-demo.toml names no stage optimizer.
    muon = ["train.optimizer=muon", "train.muon_adjust_lr=match_rms_adamw", "train.muon_ns_dtype=float32"]
    recipe = load_recipe("recipes/post-demo.toml", [*muon, "dpo.train.optimizer=muon", "rm.train.optimizer=lion"])
    for stage in (recipe.sft, recipe.grpo, recipe.ppo, recipe.distill):
        cfg = stage.train.train_config(recipe.train)
        assert cfg.optimizer == "adamw" and cfg.muon_adjust_lr == "original" and cfg.muon_ns_dtype == "auto"
        cfg.validate()  # [train]'s muon_* keys tune pretraining's Muon; they do not reach the AdamW stage
    same = recipe.dpo.train.train_config(recipe.train)  # naming [train]'s optimizer keeps its keys
    assert same.optimizer == "muon" and same.muon_adjust_lr == "match_rms_adamw" and same.muon_ns_dtype == "float32"
    assert recipe.rm.train.train_config(recipe.train).optimizer == "lion"
    lion = load_recipe(  # nor Lion
        "recipes/post-demo.toml",
        ["train.optimizer=lion", "train.muon_adjust_lr=original", "train.optimizer_impl=foreach"],
    )
    assert lion.sft.train.train_config(lion.train).optimizer == "adamw"
    with pytest.raises(ConfigError, match="sft.train.optimizer"):
        load_recipe("recipes/tiny.toml", ["sft.train.optimizer=sgd"])


def test_a_stage_optimizer_that_contradicts_train_is_refused_at_load_under_the_stage():
    """[train] optimizer_impl = "fused" and [sft.train] optimizer = "lion": each table is valid on
    its own, so the stage's derived config is judged before any stage starts, named by stage."""
    with pytest.raises(ConfigError, match=r"sft\.train: with \[train\]'s other keys, optimizer_impl: fused"):
        load_recipe("recipes/tiny.toml", ["sft.train.optimizer=lion"])
    recipe = load_recipe("recipes/tiny.toml", ["sft.train.optimizer=lion", "train.optimizer_impl=foreach"])
    assert recipe.sft.train.train_config(recipe.train).optimizer == "lion"
    # A stage the run does not list is not judged: dpo is not in tiny's run.stages.
    load_recipe("recipes/tiny.toml", ["dpo.train.optimizer=lion"])


def test_tiny_recipe_pretrains_with_muon_and_post_trains_with_adamw():
    """The chain measured over three seeds (docs/benchmarks.md, "The tiny recipe")."""
    recipe = load_recipe("recipes/tiny.toml")
    assert (recipe.train.optimizer, recipe.train.muon_adjust_lr) == ("muon", "match_rms_adamw")
    for stage in (recipe.sft, recipe.dpo, recipe.grpo, recipe.rm, recipe.ppo, recipe.distill):
        cfg = stage.train.train_config(recipe.train)
        assert cfg.optimizer == "adamw" and cfg.muon_adjust_lr == "original"
    # Another pretraining optimizer on the command line: the recipe's Muon key is refused by name,
    # with the value that clears it.
    with pytest.raises(ConfigError, match=r"train.muon_adjust_lr: .*muon_adjust_lr = 'original', its default"):
        load_recipe("recipes/tiny.toml", ["train.optimizer=adamw"])
    assert (
        load_recipe("recipes/tiny.toml", ["train.optimizer=adamw", "train.muon_adjust_lr=original"]).train.optimizer
        == "adamw"
    )


def test_chat_recipe_pretrains_with_muon_fine_tunes_with_adamw_and_ships_no_grpo():
    """The chat chain measured over seeds (docs/benchmarks.md, "The chat recipe"): GRPO did not
    raise held-out accuracy over SFT, so it is not in run.stages; its measured setting stays."""
    recipe = load_recipe("recipes/chat.toml")
    assert (recipe.train.optimizer, recipe.train.muon_adjust_lr) == ("muon", "match_rms_adamw")
    assert recipe.run.stages == ["corpus", "data", "tokenizer", "pack", "pretrain", "sft", "export"]
    for stage in (recipe.sft, recipe.grpo):
        assert stage.train.train_config(recipe.train).optimizer == "adamw"
    assert (recipe.grpo.prompt_seed, recipe.grpo.train.max_steps, recipe.grpo.train.lr) == (1, 200, 5e-5)


def test_post_stages_do_not_inherit_the_pretraining_batch_ramp():
    recipe = load_recipe("recipes/tiny.toml", ["train.batch_ramp_steps=30", "train.batch_ramp_start_tokens=2048"])
    cfg = recipe.sft.train.train_config(recipe.train)
    cfg.validate()
    assert (cfg.batch_ramp_steps, cfg.batch_ramp_start_tokens) == (0, 0)


def test_stage_configs_load_without_torch():
    # Recipes are parsed by data-only commands: the post-training configs must not import torch on
    # import, and their defaults must validate (every recipe validates every section, used or not).
    code = (
        "import sys; from kiln.post.config import DistillConfig, PPOConfig, RMConfig; "
        "RMConfig().validate(); PPOConfig().validate(); "
        "DistillConfig().validate(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert config.KL_ESTIMATORS == losses.KL_ESTIMATORS and config.DISTILL_KINDS == losses.DISTILL_KINDS
