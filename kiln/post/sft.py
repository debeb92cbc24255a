"""`kiln sft`: supervised fine-tuning on chat conversations (see docs/post.md).

Data: the [tasks] train split as conversations and/or JSONL conversation files, rendered with the
chat template (loss on assistant tokens and their closing `<|end|>` only), best-fit packed several
per row. Packed conversations do not attend to each other (document ids) and restart their
positions. Validation: the SFT loss of the held-out task answers. Measured: held-out task
accuracy before and after. The policy is fine-tuned fully or with the recipe's [peft], whose
adapter (and merged weights for LoRA/QLoRA) the stage writes; the driver (kiln.post.driver) runs
these parts on the shared Trainer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.post.data import read_sft
from kiln.post.protocol import Stage
from kiln.post.rows import IGNORE, sft_rows, stacked, trimmed
from kiln.post.sources import ExampleSource
from kiln.post.tasks import task_sft_examples


def sft_loss(model, batch: tuple) -> tuple[torch.Tensor, int]:
    """Next-token cross-entropy on assistant tokens only; packed conversations are kept apart by
    document masking and restart their positions."""
    targets, inputs, positions, documents = trimmed(batch[1], batch[0], batch[2], batch[3])
    logits = model(inputs, position_ids=positions, document_ids=documents)
    counted = int((targets != IGNORE).sum())
    if counted == 0:
        return logits.sum() * 0.0, 0
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    return loss, counted


def reference_answer_batches(tokenizer, examples: list[dict], seq_len: int, batch_size: int = 16) -> list[tuple]:
    """Unpacked SFT rows of each task example's prompt and reference answer, in batches: the
    validation set of the RL stages, whose validation loss is `sft_loss` on them."""
    conversations = [
        [{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": ex["answer"]}] for ex in examples
    ]
    rows, _ = sft_rows(tokenizer, conversations, seq_len, packing=False)
    return stacked(rows, batch_size)


class SFT(Stage):
    name = "sft"

    def sources(self) -> tuple[ExampleSource, ExampleSource]:
        cfg, conversations, self.data = self.cfg, [], {}
        if cfg.tasks:
            conversations += task_sft_examples(self.train_tasks)
            self.data["tasks"] = len(self.train_tasks)
        if cfg.files:
            examples, read_stats = read_sft(cfg.files)
            conversations += examples
            self.data["files"] = read_stats
        seq_len, micro, vocab = cfg.train.seq_len, cfg.train.micro_batch_size, self.tokenizer.vocab_size
        rows, row_stats = sft_rows(self.tokenizer, conversations, seq_len, cfg.packing)
        val_rows, _ = sft_rows(self.tokenizer, task_sft_examples(self.heldout), seq_len, cfg.packing)
        self.data.update(row_stats)
        return (
            ExampleSource(rows, micro, seed=self.recipe.train.seed, vocab_size=vocab),
            ExampleSource(val_rows, micro, shuffle=False, vocab_size=vocab),
        )

    def loss_fn(self):
        return sft_loss

    def results(self, trainer, summary: dict, before: dict | None) -> dict:
        return {"data": self.data, **super().results(trainer, summary, before)}
