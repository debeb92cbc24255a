"""The one driver of the post-training stages: it runs any `Stage` (kiln/post/protocol.py) on the
spine's Trainer and does the scaffolding every stage shares, once: validation, the Trainer built
from the init checkpoint with the stage's sources, loss and model preparation, training, the
stage's results, its exports (PEFT outputs by default), `stats.json` and the closing lines.

`run_stage(name, recipe, out, init, tokenizer)` is what `kiln run` and `kiln <stage>` call.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kiln.checkpoint import loaded_line, read_manifest, resolve_checkpoint
from kiln.errors import ConfigError
from kiln.model.weights import model_config_from_dict
from kiln.post.distill import Distill
from kiln.post.dpo import DPO
from kiln.post.grpo import GRPO
from kiln.post.outputs import write_stats
from kiln.post.ppo import PPO
from kiln.post.protocol import Stage
from kiln.post.rm import RM
from kiln.post.sft import SFT
from kiln.train.trainer import Trainer

STAGES: dict[str, type[Stage]] = {s.name: s for s in (SFT, RM, DPO, PPO, GRPO, Distill)}


def run_stage(name: str, recipe, out: Path, init: Path, tokenizer, resume: str = "auto", **options) -> dict:
    """Run post-training stage `name` into `out`, starting from the checkpoint `init`. `options` go
    to the stage (ppo: `reward_fn`, a custom reward)."""
    return run(STAGES[name](recipe, out, init, tokenizer, **options), resume)


def run(stage: Stage, resume: str = "auto") -> dict:
    try:
        stage.cfg.validate()
    except ConfigError as err:
        raise err.within(stage.name) from None
    stage.check()
    data = stage.sources()
    before = stage.before()
    trainer = build_trainer(stage, data, resume)
    if trainer.is_main:
        folder = resolve_checkpoint(stage.init)
        print(f"[{stage.name}] init: " + loaded_line(folder, read_manifest(folder)))
    stage.start(trainer)
    summary = trainer.fit()
    stats = stage.results(trainer, summary, before)
    if trainer.is_main:
        stats.update(stage.export(trainer, stats))
        write_stats(stage.out, stats)
        for line in stage.closing_lines(stats):
            print(line)
    return stats


def build_trainer(stage: Stage, data: tuple, resume: str) -> Trainer:
    # The config alone: the Trainer loads (and checks) the weights from init_from itself.
    folder = resolve_checkpoint(stage.init)
    model_cfg = model_config_from_dict(read_manifest(folder)["model_config"], str(folder))
    return Trainer(
        model_cfg,
        stage.cfg.train.train_config(stage.recipe.train),
        None,
        stage.out,
        recipe_dict=dataclasses.asdict(stage.recipe),
        resume=resume,
        init_from=stage.init,
        loss_fn=stage.loss_fn(),
        data=data,
        parallel=stage.recipe.parallel,
        prepare_model=stage.prepare_model,
        eval_loss_fn=stage.eval_loss_fn(),
        after_fit=stage.after_fit,
    )
