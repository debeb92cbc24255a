"""`kiln distill`: a student learns from a teacher model's generations and soft targets.

The teacher (`[distill] teacher`, any Kiln checkpoint with the same tokenizer) can do two things:
- synthetic data (`data = "teacher"`): it answers the task prompts (greedy by default, or sampled
  at `gen_temperature`, `samples_per_prompt` each); with `filter_correct` only answers the task
  grader accepts are kept (rejection sampling). `data = "answers"` trains on the reference answers
  (the tasks' own, or SFT JSONL files) instead. The generated conversations are written to
  `<out>/teacher_data.jsonl` and reused when the stage resumes.
- soft targets: at every assistant token the student is pulled towards the teacher's next-token
  distribution, alpha * T^2 * KL (forward KL(p_t||p_s) or reverse KL(p_s||p_t)) + (1 - alpha) * CE
  on the sequence (kiln.post.losses.distill_loss). alpha = 0 is pure sequence-level distillation
  (SFT on the teacher's answers) and skips the teacher's forward pass during training.

The teacher runs frozen beside the student, outside the Trainer's model: it is neither optimised nor
checkpointed. Reported: held-out task accuracy of student (before, after) and teacher, and the
held-out per-token KL(teacher || student) before and after. [peft] and its outputs as in SFT; the
driver (kiln.post.driver) runs the `Distill` stage below on the shared Trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.checkpoint import read_manifest, resolve_checkpoint
from kiln.data.chat import render_prompt
from kiln.errors import ConfigError
from kiln.peft.load import load_model
from kiln.post.config import DistillConfig
from kiln.post.data import read_prompts, read_sft
from kiln.post.evaluate import accuracy_line, complete, strip_stop, task_accuracy
from kiln.post.losses import distill_loss
from kiln.post.protocol import Stage
from kiln.post.rows import IGNORE, sft_rows
from kiln.post.sft import sft_loss
from kiln.post.sources import ExampleSource
from kiln.post.tasks import grade, task_sft_examples

DATA_FILE = "teacher_data.jsonl"


def load_teacher(path: str, vocab_size: int):
    try:
        teacher, _ = load_model(path)
    except (ValueError, OSError, RuntimeError) as err:  # CheckpointError is a ValueError
        raise ConfigError("distill.teacher", f"{path}: {err}") from None
    if teacher.cfg.vocab_size < vocab_size:
        raise ConfigError(
            "distill.teacher",
            f"teacher vocabulary {teacher.cfg.vocab_size} < the tokenizer's "
            f"{vocab_size}: teacher and student must share the tokenizer",
        )
    return teacher.requires_grad_(False)


# ---- synthetic data ----------------------------------------------------------------------------------


def teacher_conversations(
    teacher, tokenizer, examples: list[dict], cfg: DistillConfig, seed: int = 0, batch_size: int = 64
) -> tuple[list[list[dict]], dict]:
    """The teacher's answers to each example's prompt as [user, assistant] conversations (examples
    carry "messages" or a task "prompt"; with filter_correct, also "answer" and "task")."""
    jobs = [ex for ex in examples for _ in range(cfg.samples_per_prompt)]
    conversations, kept, graded, correct = [], 0, 0, 0
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        messages = [ex.get("messages") or [{"role": "user", "content": ex["prompt"]}] for ex in chunk]
        prompts = [render_prompt(tokenizer, m) for m in messages]
        outs = complete(
            teacher, tokenizer, prompts, cfg.max_new_tokens, temperature=cfg.gen_temperature, seed=seed + start
        )
        for ex, msgs, ids in zip(chunk, messages, outs):
            text = tokenizer.decode(strip_stop(tokenizer, ids))
            if ex.get("answer") is not None:
                graded += 1
                ok = grade(ex, text) == 1.0
                correct += ok
                if cfg.filter_correct and not ok:
                    continue
            conversations.append([*msgs, {"role": "assistant", "content": text}])
            kept += 1
    return conversations, {
        "generated": len(jobs),
        "kept": kept,
        "teacher_train_accuracy": correct / graded if graded else None,
    }


def _cached_conversations(out: Path, key: dict, make) -> tuple[list, dict]:
    """Teacher data generated once per stage folder: resuming does not sample the teacher again."""
    path, meta_path = out / DATA_FILE, out / (DATA_FILE + ".json")
    if path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == key:
            return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line], meta["stats"]
    conversations, stats = make()
    out.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    meta_path.write_text(json.dumps({"key": key, "stats": stats}))
    return conversations, stats


# ---- objective and measurement ----------------------------------------------------------------------


def make_distill_loss(cfg: DistillConfig, teacher):
    def loss_fn(model, batch: tuple) -> tuple[torch.Tensor, int]:
        if cfg.alpha == 0:
            return sft_loss(model, batch)
        inputs, targets, positions, documents = batch
        logits = model(inputs, position_ids=positions, document_ids=documents)
        counted = int((targets != IGNORE).sum())
        if counted == 0:
            return logits.sum() * 0.0, 0
        with torch.no_grad():
            teacher_logits = teacher(inputs, position_ids=positions, document_ids=documents)
        vocab = logits.shape[-1]
        loss = distill_loss(
            logits, teacher_logits[..., :vocab], targets, kind=cfg.kind, temperature=cfg.temperature, alpha=cfg.alpha
        )
        return loss, counted

    return loss_fn


def teacher_kl(student, teacher, rows: list[tuple], batch_size: int = 16) -> float:
    """Mean per-token KL(teacher || student) at temperature 1 over the counted tokens of `rows`."""
    modes = (student.training, teacher.training)
    student.eval()
    teacher.eval()
    device = next(student.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            inputs, targets, positions, documents = (torch.stack(p).to(device) for p in zip(*chunk))
            valid = targets != IGNORE
            s = student(inputs, position_ids=positions, document_ids=documents)[valid].float()
            t = teacher(inputs, position_ids=positions, document_ids=documents)[valid].float()[:, : s.shape[-1]]
            log_s, log_t = F.log_softmax(s, -1), F.log_softmax(t, -1)
            total += float((log_t.exp() * (log_t - log_s)).sum())
            count += int(valid.sum())
    student.train(modes[0])
    teacher.train(modes[1])
    return total / max(count, 1)


# ---- the stage -------------------------------------------------------------------------------------


def _examples(cfg: DistillConfig, tasks: list[dict], out: Path) -> tuple[list[dict], list[list[dict]]]:
    """(prompt examples for the teacher, reference conversations) from [tasks] and cfg.files."""
    prompts, conversations = [], []
    if cfg.tasks:
        prompts += tasks
        conversations += task_sft_examples(tasks)
    if cfg.files:
        if cfg.data == "teacher":
            prompts += read_prompts(cfg.files, rejected_path=out / "rejected.jsonl")[0]
        else:
            conversations += read_sft(cfg.files, rejected_path=out / "rejected.jsonl")[0]
    return prompts, conversations


class Distill(Stage):
    name = "distill"

    def check(self) -> None:
        if not self.cfg.teacher:
            raise ConfigError("distill.teacher", "a teacher checkpoint is required (a Kiln checkpoint or stage folder)")

    def sources(self) -> tuple[ExampleSource, ExampleSource]:
        cfg, tokenizer = self.cfg, self.tokenizer
        self.teacher = load_teacher(cfg.teacher, tokenizer.vocab_size)
        prompts, references = _examples(cfg, self.train_tasks, self.out)
        if cfg.data == "teacher":
            conversations, data, val_conversations = self._teacher_data(prompts)
        else:
            conversations, data = references, {"conversations": len(references)}
            val_conversations = task_sft_examples(self.heldout)
        if not conversations:
            raise ConfigError("distill.filter_correct", "the teacher answered no prompt correctly: nothing to train on")
        seq_len, micro, vocab = cfg.train.seq_len, cfg.train.micro_batch_size, tokenizer.vocab_size
        rows, row_stats = sft_rows(tokenizer, conversations, seq_len, cfg.packing)
        self.val_rows, _ = sft_rows(tokenizer, val_conversations, seq_len, cfg.packing)
        self.data = {**data, **row_stats}
        return (
            ExampleSource(rows, micro, seed=self.recipe.train.seed, vocab_size=vocab),
            ExampleSource(self.val_rows, micro, shuffle=False, vocab_size=vocab),
        )

    def _teacher_data(self, prompts: list[dict]) -> tuple[list, dict, list]:
        """The teacher's answers to the prompts (cached in the stage folder), their stats, and its
        greedy answers to the held-out prompts: the reported KL and the validation loss measure
        imitation of the teacher on problems neither saw in training."""
        cfg, seed = self.cfg, self.recipe.train.seed
        folder = resolve_checkpoint(cfg.teacher)
        key = {
            "teacher": str(folder.resolve()),
            "weights": read_manifest(folder)["files"],
            "prompts": len(prompts),
            "seed": seed,
            **{
                k: getattr(cfg, k)
                for k in ("samples_per_prompt", "gen_temperature", "max_new_tokens", "filter_correct", "files", "tasks")
            },
        }
        conversations, data = _cached_conversations(
            self.out, key, lambda: teacher_conversations(self.teacher, self.tokenizer, prompts, cfg, seed=seed)
        )
        val_cfg = DistillConfig(
            **{**cfg.__dict__, "samples_per_prompt": 1, "gen_temperature": 0.0, "filter_correct": False}
        )
        val_conversations, _ = teacher_conversations(self.teacher, self.tokenizer, self.heldout, val_cfg)
        return conversations, data, val_conversations

    def loss_fn(self):
        return make_distill_loss(self.cfg, self.teacher)

    def evaluate(self, model) -> dict:
        return {
            **task_accuracy(model, self.tokenizer, self.heldout),
            "teacher_kl": teacher_kl(model, self.teacher, self.val_rows),
        }

    def before(self) -> dict:
        student, _ = load_model(self.init)
        if student.cfg.vocab_size > self.teacher.cfg.vocab_size:
            raise ConfigError(
                "distill.teacher",
                f"teacher vocabulary {self.teacher.cfg.vocab_size} < the student's {student.cfg.vocab_size}",
            )
        before = self.evaluate(student)
        self.teacher_accuracy = task_accuracy(self.teacher, self.tokenizer, self.heldout)
        return before

    def start(self, trainer) -> None:
        self.teacher.to(trainer.device)

    def results(self, trainer, summary: dict, before: dict | None) -> dict:
        teacher = {"path": self.cfg.teacher, "heldout": self.teacher_accuracy}
        return {"data": self.data, "teacher": teacher, **super().results(trainer, summary, before)}

    def closing_lines(self, stats: dict) -> list[str]:
        before, after = stats["heldout_before"], stats["heldout_after"]
        return [
            accuracy_line(self.out.name, before, after),
            f"[{self.out.name}] teacher held-out accuracy {self.teacher_accuracy['accuracy']:.3f}; "
            f"KL(teacher||student) {before['teacher_kl']:.4f} -> {after['teacher_kl']:.4f}",
        ]
