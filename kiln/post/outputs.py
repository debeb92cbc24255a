"""What a finished stage writes besides its checkpoints: the PEFT outputs and `stats.json`."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.checkpoint import save_weights
from kiln.files import write_text_atomic
from kiln.peft.apply import parameter_counts
from kiln.peft.peft_io import merged_state_dict, save_peft_adapter, save_trainable


def save_adapter(model, model_cfg, peft, folder: Path) -> None:
    """The small trainable weights: PEFT format for LoRA/QLoRA, Kiln's own for adapters."""
    if peft.method in ("lora", "qlora"):
        save_peft_adapter(model, model_cfg, folder, peft)
    else:
        save_trainable(model, peft, folder)


def save_peft_outputs(trainer, peft, out: Path) -> dict:
    """`<out>/adapter`, and for LoRA/QLoRA `<out>/merged`: the merged plain weights the next stage and
    `kiln export hf` start from. Returns what goes under "peft" in stats.json."""
    trainable, total = parameter_counts(trainer.model)
    save_adapter(trainer.model, trainer.model_cfg, peft, out / "adapter")
    if peft.method in ("lora", "qlora"):
        save_weights(
            out / "merged",
            trainer.model_cfg,
            merged_state_dict(trainer.model),
            {"step": trainer.step, "peft": peft.method},
        )
    return {
        "method": peft.method,
        "trainable_params": trainable,
        "total_params": total,
        "adapter": str(out / "adapter"),
    }


def write_stats(out: Path, stats: dict) -> None:
    write_text_atomic(Path(out) / "stats.json", json.dumps(stats, indent=2, default=str))
