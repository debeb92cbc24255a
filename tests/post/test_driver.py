"""The driver runs every post-training stage on the shared Trainer: a short SFT, DPO and GRPO run with
LoRA through `run_stage` (the scaffolding every stage shares: validation, sources, PEFT outputs,
stats.json, the closing line), and, marked slow, a miniature `kiln run` of every stage and the
direction of the demo chain."""

import dataclasses
import json
import math

import pytest
import torch
from kiln_testing.recipes import mini_overrides

from kiln.checkpoint import save_weights
from kiln.cli import main
from kiln.data.tokenizer import Tokenizer
from kiln.errors import ConfigError
from kiln.model import build_model
from kiln.peft.config import PeftConfig
from kiln.peft.load import load_model
from kiln.pipeline import run_recipe
from kiln.post.config import DPOConfig, GRPOConfig, SFTConfig, StageTrainConfig, TaskConfig
from kiln.post.driver import STAGES, run_stage
from kiln.post.evaluate import task_outcomes
from kiln.post.tasks import heldout_tasks
from kiln.recipe import POST_STAGES, Recipe, load_recipe

SHORT = StageTrainConfig(
    lr=1e-3, max_steps=2, warmup_steps=0, seq_len=48, micro_batch_size=4, eval_every=2, eval_batches=1, ckpt_every=2
)
STAGE_CONFIGS = {
    "sft": SFTConfig(train=SHORT),
    "dpo": DPOConfig(train=SHORT),
    "grpo": GRPOConfig(group_size=2, prompts_per_step=2, max_new_tokens=4, train=SHORT),
}


def short_recipe(stage: str, peft: str = "lora") -> Recipe:
    recipe = Recipe()
    recipe.train = dataclasses.replace(recipe.train, precision="fp32", peak_flops=1e12, log_every=1, compile=False)
    recipe.tasks = TaskConfig(families=["sort"], train_per_family=40, heldout_per_family=4)
    setattr(recipe, stage, STAGE_CONFIGS[stage])
    recipe.peft = PeftConfig(method=peft, r=4)
    return recipe


def strict_json(text: str):
    """json.loads as a strict parser reads it: NaN and Infinity are errors, not numbers."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_every_post_stage_has_a_stage_module():
    assert set(STAGES) == set(POST_STAGES)
    assert all(STAGES[name].__module__ == f"kiln.post.{name}" for name in STAGES)


@pytest.mark.parametrize("stage", ["sft", "dpo", "grpo"])
def test_driver_trains_measures_and_exports_a_lora_stage(tok, model_cfg, tmp_path, capsys, stage):
    torch.manual_seed(0)
    cfg = model_cfg()
    save_weights(tmp_path / "init", cfg, build_model(cfg).state_dict())
    stats = run_stage(stage, short_recipe(stage), tmp_path / stage, tmp_path / "init", tok, resume="none")
    assert stats["train"]["steps"] == 2
    assert stats["heldout_before"]["examples"] == stats["heldout_after"]["examples"] == 4
    assert stats["peft"]["method"] == "lora" and stats["peft"]["trainable_params"] < stats["peft"]["total_params"]
    assert (tmp_path / stage / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / stage / "merged" / "model.safetensors").is_file()
    assert json.loads((tmp_path / stage / "stats.json").read_text())["peft"] == stats["peft"]
    # Chat data counts no text bytes, so bits per byte is null there: never NaN, which is not JSON.
    summary = strict_json((tmp_path / stage / "summary.json").read_text())
    assert summary["final_val_bpb"] is None and summary["final_val_loss"] > 0
    val = [
        r for r in map(strict_json, (tmp_path / stage / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "val"
    ]
    assert val and all(r["val_bpb"] is None for r in val)
    assert f"[{stage}] held-out task accuracy" in capsys.readouterr().out
    if stage == "dpo":
        assert 0.0 <= stats["heldout_preferences"]["reward_accuracy"] <= 1.0
    if stage == "grpo":  # rollouts sampled from the live policy by the source bound to the Trainer
        assert stats["rollout"]["rollouts"] == 2 * 2 * 2


def test_driver_validates_the_stage_config_first(tok, tmp_path):
    recipe = short_recipe("sft")
    recipe.sft = SFTConfig(tasks=False)
    with pytest.raises(ConfigError) as err:
        run_stage("sft", recipe, tmp_path / "sft", tmp_path / "missing-init", tok)
    assert err.value.key == "sft.files"


MINI = [
    *mini_overrides(max_steps=8, warmup_steps=1, every=4),
    "tasks.heldout_per_family=8",
    "tasks.train_per_family=200",
    "sft.train.max_steps=6",
    "sft.train.warmup_steps=1",
    "sft.train.eval_every=3",
    "sft.train.ckpt_every=3",
    "dpo.train.max_steps=4",
    "dpo.train.warmup_steps=1",
    "dpo.train.eval_every=2",
    "dpo.train.ckpt_every=2",
    "grpo.train.max_steps=2",
    "grpo.train.warmup_steps=0",
    "grpo.train.eval_every=1",
    "grpo.train.ckpt_every=1",
    "grpo.group_size=4",
    "grpo.prompts_per_step=2",
    "grpo.max_new_tokens=6",
]


@pytest.mark.slow
def test_miniature_run_of_every_post_stage_with_lora(tmp_path, capsys):
    """pretrain -> sft -> rm -> dpo -> grpo (judged by the reward model) through `kiln run`, with LoRA:
    every stage trains, reports held-out accuracy, checkpoints; a LoRA stage leaves a PEFT adapter and
    merged weights the next starts from."""
    run = [
        f'run.out_dir="{tmp_path}"',
        "run.name=mini",
        *MINI,
        "rm.train.max_steps=3",
        "rm.train.warmup_steps=0",
        "rm.train.eval_every=3",
        "rm.train.ckpt_every=3",
        'run.stages=["corpus","tokenizer","pack","pretrain","sft","rm","dpo","grpo"]',
        'peft.method="lora"',
        # GRPO's rewards come from the learned reward model the rm stage trained (on verifier-derived task pairs).
        f'grpo.reward_model="{tmp_path}/mini/rm"',
    ]
    assert main(["run", "recipes/tiny.toml", *run]) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "mini"
    for stage in ("sft", "dpo", "grpo"):
        assert (run_dir / stage / "DONE").exists(), stage
        assert f"[{stage}] held-out task accuracy" in out
        stats = json.loads((run_dir / stage / "stats.json").read_text())
        assert stats["heldout_after"]["examples"] == 2 * 8  # tiny.toml: reverse and sort, 8 held out each
        assert stats["peft"]["trainable_params"] < stats["peft"]["total_params"] / 5
        assert (run_dir / stage / "merged" / "model.safetensors").is_file()
        assert json.loads((run_dir / stage / "adapter" / "adapter_config.json").read_text())["r"] > 0
    dpo = json.loads((run_dir / "dpo" / "stats.json").read_text())
    assert 0.0 <= dpo["heldout_preferences"]["reward_accuracy"] <= 1.0
    grpo = json.loads((run_dir / "grpo" / "stats.json").read_text())
    assert grpo["rollout"]["rollouts"] >= 2 * 2 * 4
    # A rerun skips every finished stage.
    assert main(["run", "recipes/tiny.toml", *run]) == 0
    assert capsys.readouterr().out.count("skipping") == 8


@pytest.mark.slow
def test_sft_then_grpo_raise_heldout_task_accuracy(tmp_path):
    """The direction of the demo chain (recipes/tiny.toml: pretrain -> SFT -> GRPO) on a smaller,
    faster configuration: SFT raises held-out accuracy on the reverse/sort tasks and GRPO does not
    lower it. Seeds are the recipe's (train.seed 1337, tasks.seed 0); 120 GRPO steps at temperature
    0.7. Held-out accuracy SFT -> GRPO, measured per machine kind: 0.27 -> 0.32 (bf16) and 0.31 -> 0.35
    (fp32) on AMD Zen 4; 0.27 -> 0.24 on Intel with AMX; four problems lost net (fp32) on the AVX2-only
    Zen 3; with the recipe's Muon pretraining (since 2026-12-07) 0.49 -> 0.50 on Zen 4 in bf16. The
    change is machine noise around zero, so "does not lower it" is a paired sign test on the
    problems the two checkpoints disagree on (docs/benchmarks.md), not a fixed count."""
    recipe = load_recipe(
        "recipes/tiny.toml",
        [
            f'run.out_dir="{tmp_path}"',
            "run.name=direction",
            "corpus.max_bytes_per_source=120000",
            "tokenizer.vocab_size=512",
            "model.dim=128",
            "model.n_layers=4",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.max_seq_len=64",
            "train.seq_len=64",
            "train.micro_batch_size=8",
            "train.global_batch_tokens=512",
            "train.max_steps=10",
            "train.warmup_steps=1",
            "train.eval_every=10",
            "train.ckpt_every=10",
            "train.compile=false",
            'run.stages=["corpus","tokenizer","pack","pretrain","sft","grpo"]',
            'tasks.families=["reverse","sort"]',
            "tasks.heldout_per_family=50",
            "sft.train.max_steps=700",
            "sft.train.lr=2e-3",
            "sft.train.warmup_steps=50",
            "sft.train.eval_every=350",
            "sft.train.ckpt_every=350",
            # The setting that beat SFT in docs/benchmarks.md's GRPO table (the test's earlier 20 steps at
            # lr 5e-5 and temperature 1 lost 0.03-0.04 on Intel with AMX).
            "grpo.train.max_steps=120",
            "grpo.train.lr=1e-4",
            "grpo.train.eval_every=40",
            "grpo.train.ckpt_every=40",
            "grpo.temperature=0.7",
            "grpo.train.warmup_steps=2",
            # RL on the SFT problems, as measured (the recipe's fresh prompt_seed was measured on its own model).
            "grpo.prompt_seed=0",
        ],
    )
    assert recipe.train.seed == 1337 and recipe.tasks.seed == 0
    results = run_recipe(recipe)
    sft, grpo = results["sft"], results["grpo"]
    assert sft["heldout_before"]["accuracy"] < 0.05  # never saw the chat format
    assert sft["heldout_after"]["accuracy"] >= 0.1  # measured 0.27-0.31 (AdamW pretraining), 0.49 (Muon)
    # GRPO starts from SFT's final weights (greedy evaluation is deterministic). Its gain is within
    # what the machine kind moves (docs/benchmarks.md), so what is asserted is that it loses no more
    # problems than chance would; the advantage's sign flipped loses 27 and gains 1.
    assert grpo["heldout_before"]["accuracy"] == sft["heldout_after"]["accuracy"]
    tokenizer = Tokenizer.load(tmp_path / "direction" / "tokenizer" / "tokenizer.json")
    heldout = heldout_tasks(recipe.tasks)
    outcomes = {}
    for stage, steps in (("sft", 700), ("grpo", 120)):  # the final weights, which heldout_after measured
        model, _ = load_model(tmp_path / "direction" / stage / "checkpoints" / f"step-{steps:08d}")
        outcomes[stage] = task_outcomes(model, tokenizer, heldout)
        assert sum(outcomes[stage]) / len(heldout) == results[stage]["heldout_after"]["accuracy"]
    lost = sum(1 for a, b in zip(outcomes["sft"], outcomes["grpo"]) if a > b)
    gained = sum(1 for a, b in zip(outcomes["sft"], outcomes["grpo"]) if b > a)
    # One-sided sign test: were GRPO no worse than SFT, each disagreement would be a loss with
    # probability 1/2. p < 0.01 means GRPO lost significantly more problems than it gained.
    p = sum(math.comb(lost + gained, k) for k in range(lost, lost + gained + 1)) / 2 ** (lost + gained)
    assert p >= 0.01, f"GRPO lost {lost} held-out problems SFT solved and gained {gained} (sign test p = {p:.4f})"
    assert grpo["rollout"]["rollouts"] == 120 * 8 * 8
