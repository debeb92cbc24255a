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
held-out per-token KL(teacher || student) before and after.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.errors import ConfigError
from kiln.post.config import DistillConfig

IGNORE = -100
DATA_FILE = "teacher_data.jsonl"


def load_teacher(path: str, vocab_size: int):
    from kiln.model.weights import load_model

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
    from kiln.data.chat import render_prompt
    from kiln.post.stages import complete, strip_stop
    from kiln.post.tasks import grade

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
    import torch

    from kiln.post.losses import distill_loss
    from kiln.post.stages import sft_loss

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
    import torch
    import torch.nn.functional as F

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


def _examples(recipe, cfg: DistillConfig, out: Path) -> tuple[list[dict], list[list[dict]]]:
    """(prompt examples for the teacher, reference conversations) from [tasks] and cfg.files."""
    from kiln.post import stages as S
    from kiln.post.tasks import task_sft_examples

    prompts, conversations = [], []
    if cfg.tasks:
        tasks = S.train_tasks(recipe.tasks)
        prompts += tasks
        conversations += task_sft_examples(tasks)
    if cfg.files:
        if cfg.data == "teacher":
            from kiln.post.data import read_prompts

            prompts += read_prompts(cfg.files, rejected_path=out / "rejected.jsonl")[0]
        else:
            from kiln.post.data import read_sft

            conversations += read_sft(cfg.files, rejected_path=out / "rejected.jsonl")[0]
    return prompts, conversations


def run_distill(recipe, out: Path, init: Path, tokenizer, resume: str = "auto") -> dict:
    from kiln.model.weights import load_model
    from kiln.post import stages as S
    from kiln.post.run import _finish, _peft, _trainer
    from kiln.post.sources import ExampleSource
    from kiln.post.tasks import task_sft_examples

    cfg = recipe.distill
    try:
        cfg.validate()
    except ConfigError as err:
        raise err.within("distill") from None
    if not cfg.teacher:
        raise ConfigError("distill.teacher", "a teacher checkpoint is required (a Kiln checkpoint or stage folder)")
    out = Path(out)
    teacher = load_teacher(cfg.teacher, tokenizer.vocab_size)
    prompts, references = _examples(recipe, cfg, out)
    heldout = S.heldout_tasks(recipe.tasks)
    seed = recipe.train.seed
    if cfg.data == "teacher":
        from kiln.checkpoint import read_manifest, resolve_checkpoint

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
            out, key, lambda: teacher_conversations(teacher, tokenizer, prompts, cfg, seed=seed)
        )
        # Held out: the teacher's greedy answers to the held-out prompts, so the reported KL and the
        # validation loss measure imitation of the teacher on problems neither saw in training.
        val_cfg = DistillConfig(
            **{**cfg.__dict__, "samples_per_prompt": 1, "gen_temperature": 0.0, "filter_correct": False}
        )
        val_conversations, _ = teacher_conversations(teacher, tokenizer, heldout, val_cfg)
    else:
        conversations, data = references, {"conversations": len(references)}
        val_conversations = task_sft_examples(heldout)
    if not conversations:
        raise ConfigError("distill.filter_correct", "the teacher answered no prompt correctly: nothing to train on")
    seq_len = cfg.train.seq_len
    rows, row_stats = S.sft_rows(tokenizer, conversations, seq_len, cfg.packing)
    val_rows, _ = S.sft_rows(tokenizer, val_conversations, seq_len, cfg.packing)
    vocab = tokenizer.vocab_size
    train = ExampleSource(rows, cfg.train.micro_batch_size, seed=seed, vocab_size=vocab)
    val = ExampleSource(val_rows, cfg.train.micro_batch_size, shuffle=False, vocab_size=vocab)

    student, _ = load_model(init)
    if student.cfg.vocab_size > teacher.cfg.vocab_size:
        raise ConfigError(
            "distill.teacher", f"teacher vocabulary {teacher.cfg.vocab_size} < the student's {student.cfg.vocab_size}"
        )
    before = {**S.task_accuracy(student, tokenizer, heldout), "teacher_kl": teacher_kl(student, teacher, val_rows)}
    teacher_acc = S.task_accuracy(teacher, tokenizer, heldout)
    del student
    trainer = _trainer(
        recipe, out, cfg, (train, val), make_distill_loss(cfg, teacher), init, resume, prepare_model=_peft(recipe)
    )
    teacher.to(trainer.device)
    # Trains, measures held-out accuracy, writes the PEFT outputs and stats.json, as every stage does.
    stats = _finish(
        trainer,
        tokenizer,
        heldout,
        before,
        out,
        {"data": {**data, **row_stats}, "teacher": {"path": cfg.teacher, "heldout": teacher_acc}},
        recipe,
    )
    after = stats["heldout_after"]["teacher_kl"] = teacher_kl(trainer.model, teacher, val_rows)
    if trainer.is_main:
        S.write_stats(out, stats)
        print(
            f"[{out.name}] teacher held-out accuracy {teacher_acc['accuracy']:.3f}; KL(teacher||student) "
            f"{before['teacher_kl']:.4f} -> {after:.4f}"
        )
    return stats
