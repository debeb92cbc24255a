"""The interface of a post-training stage: what a stage module declares, in the order the driver
(kiln/post/driver.py) uses it.

Each stage (kiln/post/sft.py, rm.py, dpo.py, ppo.py, grpo.py, distill.py) is one subclass of `Stage`
constructed with (recipe, out, init, tokenizer). The driver then:

1. validates `recipe.<name>` (its `validate()`, errors named `<name>.<key>`) and calls `check()`;
2. `sources()` -> the (train, val) batch sources (`kiln.post.sources`); any frozen model the data
   needs (the reference of DPO, PPO and GRPO: `reference_model()`; distill's teacher) is loaded here;
3. `before()` -> the held-out metric of the starting weights, measured before the Trainer exists;
4. builds the shared Trainer from the init checkpoint with `loss_fn()`, `eval_loss_fn()` (None: the
   loss), `prepare_model` (runs after the init weights load, before a resumed checkpoint's) and
   `after_fit` (runs at the end of fit(), metrics still open); a source with `bind(trainer)` is
   bound to it, so online sources sample from the live policy;
5. `start(trainer)` (e.g. move frozen models to the trainer's device), then `trainer.fit()`;
6. `results(trainer, summary, before)` -> the stage's stats; on the main rank `export(trainer,
   stats)` writes what the stage leaves besides checkpoints and adds its entries to the stats, `stats.json` is written and `closing_lines`
   printed.

The defaults below are those of a stage measured by held-out task accuracy that fine-tunes the
policy with the recipe's `[peft]`; a stage overrides what it does differently.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from kiln.peft.apply import apply_peft
from kiln.peft.load import load_model
from kiln.post.evaluate import accuracy_line, task_accuracy
from kiln.post.outputs import save_peft_outputs
from kiln.post.tasks import heldout_tasks, train_tasks
from kiln.train.objective import LossFn


def peft_of(recipe):
    """The recipe's [peft] section, or None for full fine-tuning."""
    cfg = getattr(recipe, "peft", None)
    return None if cfg is None or cfg.method == "none" else cfg


class Stage:
    name = ""  # the recipe section (recipe.<name>) and the prefix of the closing lines

    def __init__(self, recipe, out: Path, init: Path, tokenizer):
        self.recipe, self.out, self.init, self.tokenizer = recipe, Path(out), Path(init), tokenizer
        self.cfg = getattr(recipe, self.name)
        self.peft = peft_of(recipe)

    @cached_property
    def heldout(self) -> list[dict]:
        """The [tasks] held-out problems."""
        return heldout_tasks(self.recipe.tasks)

    @cached_property
    def train_tasks(self) -> list[dict]:
        """The [tasks] train-split problems."""
        return train_tasks(self.recipe.tasks)

    def check(self) -> None:
        """Validation beyond `recipe.<name>.validate()`."""

    def sources(self) -> tuple:
        raise NotImplementedError

    def loss_fn(self) -> LossFn:
        raise NotImplementedError

    def eval_loss_fn(self) -> LossFn | None:
        return None

    def prepare_model(self, model) -> None:
        if self.peft is not None:
            apply_peft(model, self.peft)

    def evaluate(self, model) -> dict:
        """The stage's held-out metric of `model`."""
        return task_accuracy(model, self.tokenizer, self.heldout)

    def reference_model(self):
        """The stage's starting weights as a frozen model (eval mode, no gradients): the reference
        of DPO, PPO and GRPO's KL term."""
        model, _ = load_model(self.init)
        return model.eval().requires_grad_(False)

    def before(self) -> dict | None:
        model, _ = load_model(self.init)
        return self.evaluate(model)

    def start(self, trainer) -> None:
        pass

    def after_fit(self, trainer) -> None:
        pass

    def results(self, trainer, summary: dict, before: dict | None) -> dict:
        return {"train": summary, "heldout_before": before, "heldout_after": self.evaluate(trainer.model)}

    def export(self, trainer, stats: dict) -> dict:
        if self.peft is None:
            return {}
        return {"peft": save_peft_outputs(trainer, self.peft, self.out)}

    def closing_lines(self, stats: dict) -> list[str]:
        return [accuracy_line(self.out.name, stats["heldout_before"], stats["heldout_after"])]
