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
With `heads = N` the head is `Linear(dim, N)`, each head trained on its own bootstrap resample of
the pairs (Poisson(1) weights): an ensemble PPO and GRPO aggregate (kiln.post.reward_controls).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from torch import nn

from kiln.checkpoint import MANIFEST_FILE, save_weights
from kiln.data.chat import render_conversation
from kiln.errors import ConfigError
from kiln.model import Transformer
from kiln.model.weights import load_weights
from kiln.peft.apply import apply_peft
from kiln.peft.peft_io import merged_state_dict
from kiln.post.config import RMConfig
from kiln.post.data import read_preferences
from kiln.post.losses import bradley_terry_loss
from kiln.post.protocol import Stage
from kiln.post.sources import ExampleSource
from kiln.post.tasks import task_preference_pairs

HEAD = {"kind": "scalar", "outputs": 1, "reduction": "last_token"}
EXPORT_DIR = "reward_model"


def head_manifest(heads: int) -> dict:
    return {**HEAD, "outputs": heads}


# ---- the scalar head -------------------------------------------------------------------------------


def attach_scalar_head(model: nn.Module, heads: int = 1) -> nn.Linear:
    """Replace the model's vocabulary head by a fresh `Linear(dim, heads)` (no bias: Bradley-Terry is
    blind to a constant, and without one an untied model keeps its key set). Returns the head; each
    of its rows is one scalar head, drawn independently (an ensemble member's own initialisation)."""
    param = model.tok_embeddings.weight
    head = nn.Linear(model.cfg.dim, heads, bias=False, device=param.device, dtype=param.dtype)
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
    vocab = manifest["model_config"].get("vocab_size", 0)
    return weight is not None and weight.shape[0] < vocab and vocab > 1  # an LM's head has a row per token


def load_scalar_model(path, key: str = "reward_model") -> nn.Module:
    """A reward model (or critic) saved by `kiln rm`, in eval mode. `path`: the rm stage folder (its
    `reward_model` export is used), the export itself, or a training checkpoint of the stage."""
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
    attach_scalar_head(model, state["output.weight"].shape[0])
    model.load_state_dict(state)
    return model.eval()


def head_scores(model: nn.Module, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Every scalar head's value at each row's last real token: ids [B, T], last [B] -> [B, heads]
    float32. The padding after `last` cannot reach it through causal attention."""
    values = model(ids)
    index = last.long()[:, None, None].expand(-1, 1, values.shape[-1])
    return values.gather(1, index)[:, 0].float()


def sequence_scores(model: nn.Module, ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The reward at each row's last real token, [B]: the mean over the heads (the one head's value
    for a single-head model)."""
    return head_scores(model, ids, last).mean(-1)


def model_reward(model: nn.Module, tokenizer, batch_size: int = 32, heads: bool = False):
    """A reward function (examples, prompt ids, completion ids) -> [N] scores: the reward model's
    value at the last token of prompt + completion (PPO's and GRPO's learned reward); with `heads`,
    every head's value, [N, heads]."""
    pad = tokenizer.token_id("<|pad|>")
    score = head_scores if heads else sequence_scores

    @torch.no_grad()
    def reward(examples, prompts, completions):
        device = next(model.parameters()).device
        seqs = [p + c for p, c in zip(prompts, completions)]
        scores = []
        for start in range(0, len(seqs), batch_size):
            chunk = seqs[start : start + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk], device=device)
            last = torch.tensor([len(s) - 1 for s in chunk], device=device)
            scores.append(score(model, ids, last).cpu())
        return torch.cat(scores)

    return reward


# ---- data ------------------------------------------------------------------------------------------


def rm_rows(tokenizer, pairs: list[tuple[list[dict], str, str]], seq_len: int) -> tuple[list[tuple], int]:
    """(chosen ids [T], chosen last index, rejected ids [T], rejected last index) per pair, each the
    whole rendered conversation (its closing `<|end|>` included), right-padded. Returns the rows
    and how many sequences were cut at seq_len."""
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


def bootstrap_weights(rows: list[tuple], heads: int, seed: int) -> list[tuple]:
    """Each row with a [heads] tensor of Poisson(1) counts appended: how many times each head's
    bootstrap resample of the pairs holds this pair (the online bootstrap; fixed by seed and row)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7)
    counts = torch.poisson(torch.ones(len(rows), heads), generator=g)
    return [(*row, counts[i]) for i, row in enumerate(rows)]


def pair_loss(model, batch: tuple, margin: float = 0.0, center_coef: float = 0.0) -> torch.Tensor:
    """Bradley-Terry loss of (chosen, chosen last, rejected, rejected last[, weights]) rows, every
    head on its own scores; weights [B, heads] (the bootstrap counts) weigh each head's pairs."""
    chosen, chosen_last, rejected, rejected_last, *weights = batch
    # One forward over both halves: the same weights score chosen and rejected in one pass.
    scores = head_scores(model, torch.cat([chosen, rejected]), torch.cat([chosen_last, rejected_last]))
    r_chosen, r_rejected = scores.chunk(2)
    return bradley_terry_loss(
        r_chosen, r_rejected, margin=margin or None, center_coef=center_coef, weights=weights[0] if weights else None
    )


def make_rm_loss(cfg: RMConfig):
    def loss_fn(model, batch: tuple) -> tuple[torch.Tensor, int]:
        return pair_loss(model, batch, cfg.margin, cfg.center_coef), batch[0].shape[0]

    return loss_fn


def preference_accuracy(model: nn.Module, rows: list[tuple], batch_size: int = 32) -> dict:
    """Pairwise accuracy (chosen scored strictly higher) and mean score margin over `rows`, of the
    mean over the heads; with several heads, each head's accuracy too."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    margins = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = [row[:4] for row in rows[start : start + batch_size]]
            c, cl, r, rl = (torch.stack(p).to(device) for p in zip(*chunk))
            rc, rr = head_scores(model, torch.cat([c, r]), torch.cat([cl, rl])).chunk(2)
            margins.append((rc - rr).cpu())
    model.train(was_training)
    per_head = torch.cat(margins)
    mean = per_head.mean(-1)
    out = {"accuracy": (mean > 0).float().mean().item(), "mean_margin": mean.mean().item(), "pairs": len(mean)}
    if per_head.shape[-1] > 1:
        out["head_accuracy"] = (per_head > 0).float().mean(0).tolist()
    return out


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


class RM(Stage):
    name = "rm"

    def check(self) -> None:
        if self.peft is not None and self.peft.method == "adapter":
            raise ConfigError(
                "peft.method",
                "a reward model is exported as plain weights, which bottleneck "
                "adapters cannot be folded into; use lora, qlora or none",
            )

    def sources(self) -> tuple[ExampleSource, ExampleSource]:
        cfg, seed = self.cfg, self.recipe.train.seed
        task_val = task_preference_pairs(self.heldout, seed=self.recipe.tasks.seed + 1)
        if cfg.files:
            pairs, read_stats = read_preferences(cfg.files, rejected_path=self.out / "rejected.jsonl")
            pairs, val_pairs = _split_file_pairs(pairs, cfg.heldout_fraction, seed)
            data = {"files": read_stats}
        else:
            pairs, val_pairs = task_preference_pairs(self.train_tasks, seed=self.recipe.tasks.seed), task_val
            data = {"tasks": len(pairs)}
        seq_len = cfg.train.seq_len
        rows, cut = rm_rows(self.tokenizer, pairs, seq_len)
        if cfg.heads > 1:
            rows = bootstrap_weights(rows, cfg.heads, seed)
        self.val_rows, _ = rm_rows(self.tokenizer, val_pairs, seq_len)
        # With files, the held-out task pairs are measured too.
        self.task_rows = rm_rows(self.tokenizer, task_val, seq_len)[0] if cfg.files else None
        self.data = {**data, "pairs": len(rows), "heldout_pairs": len(self.val_rows), "truncated": cut}
        micro, vocab = cfg.train.micro_batch_size, self.tokenizer.vocab_size
        return (
            ExampleSource(rows, micro, seed=seed, vocab_size=vocab),
            ExampleSource(self.val_rows, micro, shuffle=False, vocab_size=vocab),
        )

    def loss_fn(self):
        return make_rm_loss(self.cfg)

    def prepare_model(self, model) -> None:
        head = attach_scalar_head(model, self.cfg.heads)
        if self.peft is not None:
            apply_peft(model, self.peft)
            # PEFT freezes every base weight; the new head has nothing to adapt from and trains fully.
            head.weight.requires_grad_(True)

    def evaluate(self, model) -> dict:
        after = {"heldout": preference_accuracy(model, self.val_rows)}
        if self.task_rows is not None:
            after["heldout_tasks"] = preference_accuracy(model, self.task_rows)
        return after

    def before(self) -> None:
        return None  # the fresh head exists only once the Trainer has built the model: see start()

    def start(self, trainer) -> None:
        """The untrained head's accuracy, measured once, on the first run, and kept for resumed runs."""
        before_file = self.out / "rm_before.json"
        if trainer.resumed_from is None:
            self.initial = {"heldout": preference_accuracy(trainer.model, self.val_rows)}
            if trainer.is_main:
                before_file.write_text(json.dumps(self.initial))
        else:
            self.initial = json.loads(before_file.read_text()) if before_file.is_file() else None

    def results(self, trainer, summary: dict, before: None) -> dict:
        return {"data": self.data, "train": summary, "before": self.initial, "after": self.evaluate(trainer.model)}

    def export(self, trainer, stats: dict) -> dict:
        """`<out>/reward_model`: plain weights (LoRA merged) with the head recorded; no adapter."""
        accuracy = stats["after"]["heldout"]["accuracy"]
        extra = {"stage": "rm", "checkpoint": stats["train"]["checkpoint"], "heldout_accuracy": accuracy}
        export_reward_model(trainer, self.out / EXPORT_DIR, extra, self.cfg.heads)
        return {"reward_model": str(self.out / EXPORT_DIR)}

    def closing_lines(self, stats: dict) -> list[str]:
        start = f"{stats['before']['heldout']['accuracy']:.3f}" if stats["before"] else "?"
        after = stats["after"]["heldout"]["accuracy"]
        return [f"[{self.out.name}] held-out pairwise accuracy {start} -> {after:.3f} ({len(self.val_rows)} pairs)"]


def export_reward_model(trainer, folder: Path, extra: dict, heads: int = 1) -> Path:
    """Plain weights (LoRA merged) of the trained reward model, with the head recorded."""
    state = merged_state_dict(trainer.model)
    return save_weights(folder, trainer.model_cfg, state, {**extra, "head": head_manifest(heads)})
