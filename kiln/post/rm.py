"""`kiln rm`: a reward model, the transformer with a scalar head, trained on preference pairs.

The model is the policy architecture with its vocabulary head replaced by `nn.Linear(dim, 1)`:
`Transformer.forward` ends with `self.output(x)` whenever `output` is a module, so the same model
code gives [B, T, 1] values without a second architecture (a tied model gets an untied scalar head
the same way). A sequence's reward is the value at its last token: the assistant's closing
`<|end|>` for a rendered pair, the last completion token for a rollout.

Training minimises the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin) on (prompt,
chosen, rejected) triples from JSONL files or from Kiln's verifiable tasks (correct answer over a
plausible wrong one). The stage reports pairwise accuracy on held-out pairs before and after, and
writes `<out>/reward_model`: a weights-only checkpoint whose manifest carries `"head": {"kind":
"scalar", ...}`, which `load_scalar_model` (PPO's reward and critic) reads back. Training
checkpoints under `<out>/checkpoints` hold the same tensors; their head is recognised by shape.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.errors import ConfigError
from kiln.post.config import RMConfig

IGNORE = -100
if TYPE_CHECKING:
    import torch
    from torch import nn

HEAD = {"kind": "scalar", "outputs": 1, "reduction": "last_token"}
EXPORT_DIR = "reward_model"


# ---- the scalar head -------------------------------------------------------------------------------


def attach_scalar_head(model: nn.Module) -> nn.Linear:
    """Replace the model's vocabulary head by a fresh `Linear(dim, 1)` (no bias: Bradley-Terry is
    blind to a constant, and without one an untied model keeps its key set). Returns the head."""
    from torch import nn

    param = model.tok_embeddings.weight
    head = nn.Linear(model.cfg.dim, 1, bias=False, device=param.device, dtype=param.dtype)
    # Small weights start every reward near 0, so the first pairwise losses are about log 2 and
    # the trunk is not pushed by an arbitrary initial ranking.
    nn.init.normal_(head.weight, std=1.0 / (model.cfg.dim + 1))
    model.output = head  # a tied model had output=None: forward now calls the head instead
    return head


def has_scalar_head(state: dict, manifest: dict) -> bool:
    head = manifest.get("head")
    if isinstance(head, dict):
        return head.get("kind") == "scalar"
    weight = state.get("output.weight")
    return weight is not None and weight.shape[0] == 1 and manifest["model_config"].get("vocab_size", 0) > 1


def load_scalar_model(path, key: str = "reward_model") -> nn.Module:
    """A reward model (or critic) saved by `kiln rm`, in eval mode. `path`: the rm stage folder (its
    `reward_model` export is used), the export itself, or a training checkpoint of the stage."""
    from kiln.checkpoint import MANIFEST_FILE
    from kiln.model import Transformer
    from kiln.model.weights import load_weights

    p = Path(path)
    if (p / EXPORT_DIR / MANIFEST_FILE).is_file():
        p = p / EXPORT_DIR
    try:
        cfg, state, manifest = load_weights(p)
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError
        raise ConfigError(key, f"{path}: {err}") from None
    if not has_scalar_head(state, manifest):
        raise ConfigError(
            key, f"{path} is a language model, not a reward model (no scalar head); train one with `kiln rm`"
        )
    if any(".lora_" in k or ".adapter." in k for k in state):
        raise ConfigError(
            key, f"{path} is a PEFT training checkpoint; use the merged export <rm stage>/{EXPORT_DIR} instead"
        )
    model = Transformer(cfg)
    attach_scalar_head(model)
    model.load_state_dict(state)
    return model.eval()


def sequence_scores(model: nn.Module, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Scalar-head value at each row's last real token: ids [B, T], last [B] indices -> [B] float32.
    The padding after `last` cannot reach it through causal attention."""
    values = model(ids)[..., 0]
    return values.gather(1, last.long()[:, None])[:, 0].float()


# ---- data ------------------------------------------------------------------------------------------


def rm_rows(tokenizer, pairs: list[tuple[list[dict], str, str]], seq_len: int) -> tuple[list[tuple], int]:
    """(chosen ids [T], chosen last index, rejected ids [T], rejected last index) per pair, each the
    whole rendered conversation (its closing `<|end|>` included), right-padded. Returns the rows
    and how many sequences were cut at seq_len."""
    import torch

    from kiln.data.chat import render_conversation

    pad = tokenizer.token_id("<|pad|>")
    rows, cut = [], 0
    for prompt, chosen, rejected in pairs:
        row = []
        for answer in (chosen, rejected):
            ids, _ = render_conversation(tokenizer, [*prompt, {"role": "assistant", "content": answer}])
            if len(ids) > seq_len:
                cut += 1
                ids = ids[:seq_len]
            row += [torch.tensor(ids + [pad] * (seq_len - len(ids))), torch.tensor(len(ids) - 1)]
        rows.append(tuple(row))
    return rows, cut


def make_rm_loss(cfg: RMConfig):
    import torch

    from kiln.post.losses import bradley_terry_loss

    def loss_fn(model, batch: tuple) -> tuple[torch.Tensor, int]:
        chosen, chosen_last, rejected, rejected_last = batch
        # One forward over both halves: the same weights score chosen and rejected in one pass.
        scores = sequence_scores(model, torch.cat([chosen, rejected]), torch.cat([chosen_last, rejected_last]))
        r_chosen, r_rejected = scores.chunk(2)
        loss = bradley_terry_loss(r_chosen, r_rejected, margin=cfg.margin or None, center_coef=cfg.center_coef)
        return loss, chosen.shape[0]

    return loss_fn


def preference_accuracy(model: nn.Module, rows: list[tuple], batch_size: int = 32) -> dict:
    """Pairwise accuracy (chosen scored strictly higher) and mean score margin over `rows`."""
    import torch

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    margins = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            c, cl, r, rl = (torch.stack(p).to(device) for p in zip(*rows[start : start + batch_size]))
            scores = sequence_scores(model, torch.cat([c, r]), torch.cat([cl, rl]))
            rc, rr = scores.chunk(2)
            margins += (rc - rr).tolist()
    model.train(was_training)
    return {
        "accuracy": sum(m > 0 for m in margins) / len(margins),
        "mean_margin": sum(margins) / len(margins),
        "pairs": len(margins),
    }


def _split_file_pairs(pairs: list, fraction: float, seed: int) -> tuple[list, list]:
    order = list(range(len(pairs)))
    random.Random(f"kiln-rm-split|{seed}").shuffle(order)
    n_val = max(1, round(len(pairs) * fraction))
    if len(pairs) - n_val < 1:
        raise ConfigError(
            "rm.files", f"{len(pairs)} preference pair(s) leave none to train on after holding out {n_val}"
        )
    return [pairs[i] for i in order[n_val:]], [pairs[i] for i in order[:n_val]]


# ---- the stage -------------------------------------------------------------------------------------


def _prepare(recipe):
    from kiln.post.run import _peft

    peft = _peft(recipe)

    def prepare(model):
        head = attach_scalar_head(model)
        if peft is not None:
            peft(model)
            # PEFT freezes every base weight; the new head has nothing to adapt from and trains fully.
            head.weight.requires_grad_(True)

    return prepare


def run_rm(recipe, out: Path, init: Path, tokenizer, resume: str = "auto") -> dict:
    from kiln.post import stages as S
    from kiln.post.run import _trainer
    from kiln.post.sources import ExampleSource
    from kiln.post.tasks import task_preference_pairs

    cfg = recipe.rm
    try:
        cfg.validate()
    except ConfigError as err:
        raise err.within("rm") from None
    peft = getattr(recipe, "peft", None)
    if peft is not None and peft.method == "adapter":
        raise ConfigError(
            "peft.method",
            "a reward model is exported as plain weights, which bottleneck "
            "adapters cannot be folded into; use lora, qlora or none",
        )
    out = Path(out)
    heldout = S.heldout_tasks(recipe.tasks)
    task_val = task_preference_pairs(heldout, seed=recipe.tasks.seed + 1)
    if cfg.files:
        from kiln.post.data import read_preferences

        pairs, read_stats = read_preferences(cfg.files, rejected_path=out / "rejected.jsonl")
        pairs, val_pairs = _split_file_pairs(pairs, cfg.heldout_fraction, recipe.train.seed)
        data = {"files": read_stats}
    else:
        pairs, val_pairs = task_preference_pairs(S.train_tasks(recipe.tasks), seed=recipe.tasks.seed), task_val
        data = {"tasks": len(pairs)}
    seq_len = cfg.train.seq_len
    rows, cut = rm_rows(tokenizer, pairs, seq_len)
    val_rows, _ = rm_rows(tokenizer, val_pairs, seq_len)
    task_rows = val_rows if not cfg.files else rm_rows(tokenizer, task_val, seq_len)[0]
    vocab = tokenizer.vocab_size
    train = ExampleSource(rows, cfg.train.micro_batch_size, seed=recipe.train.seed, vocab_size=vocab)
    val = ExampleSource(val_rows, cfg.train.micro_batch_size, shuffle=False, vocab_size=vocab)
    trainer = _trainer(recipe, out, cfg, (train, val), make_rm_loss(cfg), init, resume, prepare_model=_prepare(recipe))

    # The untrained head's accuracy is measured once, on the first run, and kept for resumed runs.
    before_file = out / "rm_before.json"
    if trainer.resumed_from is None:
        before = {"heldout": preference_accuracy(trainer.model, val_rows)}
        if trainer.is_main:
            before_file.write_text(json.dumps(before))
    else:
        before = json.loads(before_file.read_text()) if before_file.is_file() else None
    summary = trainer.fit()
    after = {"heldout": preference_accuracy(trainer.model, val_rows)}
    if cfg.files:
        after["heldout_tasks"] = preference_accuracy(trainer.model, task_rows)
    stats = {
        "data": {**data, "pairs": len(rows), "heldout_pairs": len(val_rows), "truncated": cut},
        "train": summary,
        "before": before,
        "after": after,
    }
    if trainer.is_main:
        export_reward_model(
            trainer,
            out / EXPORT_DIR,
            {"stage": "rm", "checkpoint": summary["checkpoint"], "heldout_accuracy": after["heldout"]["accuracy"]},
        )
        stats["reward_model"] = str(out / EXPORT_DIR)
        S.write_stats(out, stats)
        start = f"{before['heldout']['accuracy']:.3f}" if before else "?"
        print(
            f"[{out.name}] held-out pairwise accuracy {start} -> "
            f"{after['heldout']['accuracy']:.3f} ({len(val_rows)} pairs)"
        )
    return stats


def export_reward_model(trainer, folder: Path, extra: dict) -> Path:
    """Plain weights (LoRA merged) of the trained reward model, with the head recorded."""
    from kiln.checkpoint import save_weights
    from kiln.peft.peft_io import merged_state_dict

    return save_weights(folder, trainer.model_cfg, merged_state_dict(trainer.model), {**extra, "head": HEAD})
