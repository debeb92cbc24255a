"""Post-training step throughput: Kiln's SFT and DPO stages vs TRL's SFTTrainer and DPOTrainer.

Both sides start from the same weights and train on the same examples, in one process:

- The model is the `tiny` preset shape (dim 256, 4 layers, 4 heads, 2 KV heads) with a Kiln BPE
  tokenizer (vocab 8192) trained here on Python standard-library source. Kiln's initial weights are
  written with `kiln.hf.export_hf` (tokenizer and chat template included), and both sides load
  that folder: TRL as `LlamaForCausalLM.from_pretrained`, Kiln through `kiln.hf.import_hf_to_checkpoint`
  and `Trainer(init_from=...)`, as `kiln import hf` would.
- The data are Kiln's verifiable tasks (`generate_tasks` -> `task_sft_examples` /
  `task_preference_pairs`). Kiln renders them as its stages do (`rows.sft_rows`, `dpo.pair_rows`
  plus the precomputed reference log-probs); TRL gets the same conversations in its conversational
  prompt-completion and preference formats and renders them with the exported chat template. The
  script checks that TRL's token ids and loss labels are exactly Kiln's before timing anything.
- Kiln steps with the stage code path: `Trainer.train_step` with `sft.sft_loss` or
  `dpo.make_dpo_loss` on an `ExampleSource`, one micro-batch per step, the stage's default
  StageTrainConfig (AdamW foreach, grad clip 1.0). TRL steps through `trainer.train()` with the
  same batch size, max length, learning rate, betas, weight decay, clipping and precision, its
  defaults otherwise, except: gradient checkpointing off (TRL turns it on by default; Kiln's stages
  do not checkpoint), packing and padding-free off, logging, saving and evaluation off, CPU.

What differs by design, and is part of what is measured: Kiln pads every row to seq_len, TRL pads
each batch to its longest example; TRL's fused LM head projects only the positions that have a
label, Kiln computes all logits; Kiln's DPO reference log-probs are computed before training (TRL's
`precompute_ref_log_probs=True` does the same, and is the like-for-like row; TRL's default, a
reference forward in every step, is printed as well). Kiln with packing (its SFT default) is an
extra row: it puts several conversations in one row, so its examples/s is not a like-for-like
comparison. The "kiln-trimmed" rows are a diagnostic the stages do not do: the same Kiln step on
batches cut at their longest row (as TRL's collator pads), which shows what padding to seq_len costs.

A step is timed from the end of the previous one to its own end (data loading, forward, backward,
clipping, optimizer), so the loop's overhead counts on both sides; the first --warmup steps of each
run are left out. Examples are conversations (SFT) or preference pairs (DPO); tokens are the
rendered conversations' tokens (a pair counts both its sequences), excluding padding, counted from
each side's actual batches. Runs during which other processes kept more than 0.25 CPU cores busy
are starred (see bench/train_step.py: the machine is shared).

    python bench/post.py                       # bf16 autocast, 20 timed steps per run (~1 min when quiet)
    python bench/post.py --precision fp32 --steps 10
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_line  # bench/ (the script's folder, on sys.path)
from train_step import machine_busy_seconds  # noqa: E402

IGNORE = -100
FAMILIES = ("arithmetic", "reverse", "sort")
BUSY_CORES = 0.25


# ---- shared setup: tokenizer, model, data -------------------------------------------------------


def stdlib_texts(limit_bytes: int) -> list[str]:
    """Python standard-library source files, in a fixed order, up to limit_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text.encode("utf-8"))
        if total >= limit_bytes:
            break
    return texts


def build_model_folder(work: Path, vocab: int, seed: int) -> tuple[Path, Path, object]:
    """(HF folder, Kiln checkpoint imported from it, Kiln tokenizer)."""
    from kiln.data.config import TokenizerConfig
    from kiln.data.tokenizer import Tokenizer, train_tokenizer
    from kiln.hf import export_hf, import_hf_to_checkpoint
    from kiln.model import build_model, preset

    tok_dir = work / "tokenizer"
    train_tokenizer(stdlib_texts(3_000_000), TokenizerConfig(vocab_size=vocab), tok_dir, heldout=[])
    tokenizer = Tokenizer.load(tok_dir / "tokenizer.json")
    cfg = preset("tiny", vocab_size=tokenizer.vocab_size)
    torch.manual_seed(seed)
    model = build_model(cfg)
    hf_dir = export_hf(cfg, model.state_dict(), tok_dir, work / "hf")
    kiln_dir = import_hf_to_checkpoint(hf_dir, work / "kiln-init")
    return hf_dir, kiln_dir, tokenizer


def task_examples(per_family: int, seed: int) -> list[dict]:
    from kiln.post.tasks import generate_tasks

    return [
        ex
        for i, family in enumerate(FAMILIES)
        for ex in generate_tasks(family, per_family, split="train", difficulty=1, seed=seed + i)
    ]


# ---- timing --------------------------------------------------------------------------------------


class StepClock:
    """Step durations from consecutive step ends, plus the CPU other processes used meanwhile."""

    def __init__(self):
        self.ends: list[float] = []
        self.start = self.machine = self.ours = 0.0

    def begin(self) -> None:
        self.start = time.perf_counter()
        self.ends = []

    def tick(self, warmup: int) -> None:
        self.ends.append(time.perf_counter())
        if len(self.ends) == warmup:  # the timed window opens at the end of the last warmup step
            self.machine, self.ours = machine_busy_seconds(), sum(os.times()[:2])

    def result(self, warmup: int, counts: list[tuple[int, int, int]]) -> dict:
        """counts: (examples, tokens, positions the model ran on) of each step's batch, in order."""
        ends = [self.start] + self.ends
        seconds = ends[-1] - ends[warmup]
        others = (machine_busy_seconds() - self.machine) - (sum(os.times()[:2]) - self.ours)
        steps = len(self.ends) - warmup
        examples, tokens, positions = (sum(c[k] for c in counts[warmup : len(self.ends)]) for k in range(3))
        return {
            "steps": steps,
            "seconds": seconds,
            "examples_per_s": examples / seconds,
            "tokens_per_s": tokens / seconds,
            "positions_per_step": positions / steps,
            "step_ms": 1000 * seconds / steps,
            "others": max(others, 0.0) / seconds,
        }


# ---- Kiln ----------------------------------------------------------------------------------------


def kiln_trainer(init: Path, out: Path, stage_train, precision: str, loss_fn, rows):
    from kiln.model.weights import load_weights
    from kiln.post.sources import ExampleSource
    from kiln.train.config import TrainConfig
    from kiln.train.trainer import Trainer

    model_cfg = load_weights(init)[0]
    # peak_flops only feeds the MFU printout; giving it skips the startup matmul measurement.
    train_cfg = stage_train.train_config(TrainConfig(precision=precision, peak_flops=1e12))
    source = ExampleSource(rows, stage_train.micro_batch_size, seed=1337, vocab_size=model_cfg.vocab_size)
    shutil.rmtree(out, ignore_errors=True)
    trainer = Trainer(
        model_cfg, train_cfg, None, out, resume="none", init_from=init, loss_fn=loss_fn, data=(source, source)
    )
    return trainer, source


def run_kiln(trainer, source, total: int, warmup: int, count, trim=None) -> dict:
    clock, counts = StepClock(), []
    batches = iter(source)
    clock.begin()
    for _ in range(total):
        batch = next(batches)
        if trim is not None:
            batch = trim(batch)
        stats = trainer.train_step([batch])
        float(stats["loss"])  # waits for the step (the loop may return a tensor or a float)
        clock.tick(warmup)
        counts.append(count(batch))
    return clock.result(warmup, counts) | {"optimizer": optimizer_name(trainer), "precision": trainer.cfg.precision}


def count_sft_rows(pad: int):
    def count(batch) -> tuple[int, int, int]:
        inputs, targets, positions, _ = batch
        real = inputs != pad  # padding only ever follows a row's tokens
        # Inputs are a row's tokens but the last; that one is still a conversation token when it is
        # a target of the last input (always without packing, only in a full row with packing).
        last = (real.sum(-1, keepdim=True) - 1).clamp(min=0)
        tokens = int(real.sum()) + int((targets.gather(1, last) != IGNORE).sum())
        return int(((positions == 0) & real).sum()), tokens, inputs.numel()

    return count


def count_pair_rows(pad: int):
    def count(batch) -> tuple[int, int, int]:
        chosen, _, rejected, _ = batch[:4]
        # inputs are a sequence minus its last token (none is truncated: checked in main)
        tokens = int((chosen != pad).sum() + (rejected != pad).sum()) + 2 * chosen.shape[0]
        return chosen.shape[0], tokens, chosen.numel() + rejected.numel()

    return count


def trim_to_longest(pad: int, sequences: tuple[int, ...]):
    """Cut a batch's padding columns beyond its longest row (the tensors at `sequences` say how
    long rows are). The loss is unchanged: attention is causal and the cut columns have no target."""

    def trim(batch):
        longest = max(int((batch[i] != pad).sum(-1).max()) for i in sequences)
        return tuple(t[:, :longest] if t.dim() == 2 else t for t in batch)

    return trim


# ---- TRL -----------------------------------------------------------------------------------------


def trl_callback(clock: StepClock, warmup: int):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick(warmup)

    return Clock()


def trl_common(args, out: Path, batch: int, lr: float, max_steps: int) -> dict:
    return dict(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        max_steps=max_steps,
        learning_rate=lr,
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        bf16=args.precision == "bf16",
        use_cpu=True,
        gradient_checkpointing=False,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=1337,
        max_length=args.seq_len,
    )


def hf_model(hf_dir: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")


def run_trl(trainer, clock: StepClock, warmup: int) -> dict:
    """Train, counting each batch as the collator builds it (in step order: the dataloader may
    collate one batch ahead, never out of order)."""
    collate, counts = trainer.data_collator, []

    def counting(features):
        batch = collate(features)
        counts.append((len(features), int(batch["attention_mask"].sum()), batch["input_ids"].numel()))
        return batch

    trainer.data_collator = counting
    trainer.train()
    precision = trainer.accelerator.mixed_precision
    params = next(trainer.model.parameters()).dtype
    return clock.result(warmup, counts) | {
        "optimizer": optimizer_name(trainer),
        "precision": f"{precision} autocast, {str(params)[6:]} weights",
    }


def trl_sft(args, hf_dir: Path, work: Path, conversations, kiln_rendered, total: int) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"prompt": c[:-1], "completion": c[-1:]} for c in conversations])
    cfg = SFTConfig(
        **trl_common(args, work / "trl-sft", args.sft_batch, args.sft_lr, total),
        packing=False,
        padding_free=False,
        completion_only_loss=True,
        dataset_num_proc=None,
    )
    clock = StepClock()
    trainer = SFTTrainer(
        hf_model(hf_dir),
        args=cfg,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(hf_dir),
        callbacks=[trl_callback(clock, args.warmup)],
    )
    for i in (0, len(data) // 2, len(data) - 1):  # TRL must train on exactly Kiln's tokens and mask
        row = trainer.train_dataset[i]
        ids, mask = kiln_rendered[i]
        labels = [t if m else IGNORE for t, m in zip(ids, mask)]
        if row["input_ids"] != ids or row["labels"] != labels:
            raise SystemExit(f"TRL renders example {i} differently from Kiln:\n{row}\n{ids}\n{mask}")
    return run_trl(trainer, clock, args.warmup)


def trl_dpo(args, hf_dir: Path, work: Path, pairs, kiln_rendered, total: int, precompute: bool) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_list(
        [
            {
                "prompt": p,
                "chosen": [{"role": "assistant", "content": c}],
                "rejected": [{"role": "assistant", "content": r}],
            }
            for p, c, r in pairs
        ]
    )
    cfg = DPOConfig(
        **trl_common(args, work / "trl-dpo", args.dpo_batch, args.dpo_lr, total),
        beta=0.1,
        loss_type=["sigmoid"],
        padding_free=False,
        precompute_ref_log_probs=precompute,
    )
    clock = StepClock()
    started = time.perf_counter()
    trainer = DPOTrainer(
        hf_model(hf_dir),
        args=cfg,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(hf_dir),
        callbacks=[trl_callback(clock, args.warmup)],
    )
    setup = time.perf_counter() - started
    row = trainer.train_dataset[0]
    chosen, rejected = kiln_rendered[0]
    got = (row["prompt_ids"] + row["chosen_ids"], row["prompt_ids"] + row["rejected_ids"])
    if got != (chosen, rejected):
        raise SystemExit(f"TRL renders pair 0 differently from Kiln:\n{got}\n{(chosen, rejected)}")
    return run_trl(trainer, clock, args.warmup) | {"setup_s": setup}


def optimizer_name(trainer) -> str:
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)
    flags = [k for k in ("fused", "foreach") if opt.defaults.get(k)]
    return type(opt).__name__ + (f" ({', '.join(flags)})" if flags else "")


# ---- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each run")
    parser.add_argument("--seq-len", type=int, default=64, help="Kiln's stage seq_len default; TRL's max_length")
    parser.add_argument("--sft-batch", type=int, default=16, help="Kiln's [sft.train] micro_batch_size default")
    parser.add_argument("--dpo-batch", type=int, default=8, help="Kiln's [dpo.train] micro_batch_size default")
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--dpo-lr", type=float, default=1e-4)
    parser.add_argument("--per-family", type=int, default=200, help="task examples per family (3 families)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-bench-post"))
    args = parser.parse_args()
    print(cpu_line(), flush=True)

    from kiln.data.chat import render_conversation
    from kiln.post import dpo, sft
    from kiln.post.config import DPOConfig, StageTrainConfig
    from kiln.post.rows import sft_rows
    from kiln.post.tasks import task_preference_pairs, task_sft_examples

    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    shutil.rmtree(args.work, ignore_errors=True)
    hf_dir, kiln_dir, tokenizer = build_model_folder(args.work, 8192, seed=0)
    pad = tokenizer.token_id("<|pad|>")
    tasks = task_examples(args.per_family, seed=0)
    conversations = task_sft_examples(tasks)
    pairs = task_preference_pairs(tasks, seed=0)
    rendered = [render_conversation(tokenizer, c) for c in conversations]
    rendered_pairs = [
        tuple(render_conversation(tokenizer, [*p, {"role": "assistant", "content": a}])[0] for a in (c, r))
        for p, c, r in pairs
    ]
    longest = max(len(ids) for pair in rendered_pairs for ids in pair)
    longest = max(longest, max(len(ids) for ids, _ in rendered))
    if longest > args.seq_len + 1:
        raise SystemExit(
            f"a conversation has {longest} tokens; raise --seq-len to at least {longest - 1} "
            f"so that neither side truncates"
        )
    total = args.warmup + args.steps
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, precision {args.precision}; "
        f"{len(conversations)} conversations, {sum(len(i) for i, _ in rendered) / len(rendered):.1f} tokens "
        f"each on average (longest {longest}), seq_len {args.seq_len}; setup {time.perf_counter() - started:.1f} s"
    )

    results = {}
    sft_train = StageTrainConfig(
        lr=args.sft_lr, max_steps=total, warmup_steps=0, seq_len=args.seq_len, micro_batch_size=args.sft_batch
    )
    for side, packing, trim in (
        ("kiln", False, None),
        ("kiln-packed", True, None),
        ("kiln-trimmed", False, trim_to_longest(pad, (0,))),
    ):
        rows, _ = sft_rows(tokenizer, conversations, args.seq_len, packing)
        trainer, source = kiln_trainer(kiln_dir, args.work / "kiln-sft", sft_train, args.precision, sft.sft_loss, rows)
        results[("sft", side)] = run_kiln(trainer, source, total, args.warmup, count_sft_rows(pad), trim)
        del trainer
    results[("sft", "trl")] = trl_sft(args, hf_dir, args.work, conversations, rendered, total)

    dpo_cfg = DPOConfig(
        beta=0.1,
        loss_type="sigmoid",
        train=StageTrainConfig(
            lr=args.dpo_lr, max_steps=total, warmup_steps=0, seq_len=args.seq_len, micro_batch_size=args.dpo_batch
        ),
    )
    from kiln.model.weights import load_model

    reference, _ = load_model(kiln_dir)
    ref_started = time.perf_counter()
    rows = dpo.reference_logprobs(reference, dpo.pair_rows(tokenizer, pairs, args.seq_len), precision=args.precision)
    kiln_ref_s = time.perf_counter() - ref_started
    del reference
    for side, trim in (("kiln", None), ("kiln-trimmed", trim_to_longest(pad, (0, 2)))):
        trainer, source = kiln_trainer(
            kiln_dir, args.work / "kiln-dpo", dpo_cfg.train, args.precision, dpo.make_dpo_loss(dpo_cfg), rows
        )
        results[("dpo", side)] = run_kiln(trainer, source, total, args.warmup, count_pair_rows(pad), trim)
        del trainer
    results[("dpo", "kiln")]["setup_s"] = kiln_ref_s
    results[("dpo", "trl-precomputed")] = trl_dpo(args, hf_dir, args.work, pairs, rendered_pairs, total, True)
    results[("dpo", "trl")] = trl_dpo(args, hf_dir, args.work, pairs, rendered_pairs, total, False)

    report(results, args)
    print(f"total {time.perf_counter() - started:.0f} s")


def report(results: dict, args) -> None:
    print(
        f"\n{args.steps} timed steps after {args.warmup} warmup steps; SFT batch {args.sft_batch} conversations, "
        f"DPO batch {args.dpo_batch} pairs; positions = token slots the model ran on per step (padding "
        f"included); * = other processes used > {BUSY_CORES} cores meanwhile"
    )
    print(
        f"{'stage':5} {'side':16} {'examples/s':>10} {'tokens/s':>9} {'positions':>9} {'ms/step':>8} {'others':>6}"
        f"  optimizer; precision"
    )
    for (stage, side), r in results.items():
        star = "*" if r["others"] > BUSY_CORES else " "
        print(
            f"{stage:5} {side:16} {r['examples_per_s']:10.1f} {r['tokens_per_s']:9.0f} {r['positions_per_step']:9.0f} "
            f"{r['step_ms']:8.1f} {r['others']:5.2f}{star}  {r['optimizer']}; {r['precision']}"
            + (f"; setup {r['setup_s']:.1f} s" if "setup_s" in r else "")
        )
    print("\nratio Kiln / TRL")
    pairs = [
        ("sft", "kiln", "trl", "SFT, no packing on either side (like for like)"),
        ("sft", "kiln-packed", "trl", "SFT, Kiln packed (its default) vs TRL unpacked"),
        ("sft", "kiln-trimmed", "trl", "SFT, diagnostic: Kiln batches cut to their longest row"),
        ("dpo", "kiln", "trl-precomputed", "DPO, reference log-probs precomputed on both sides (like for like)"),
        ("dpo", "kiln", "trl", "DPO, vs TRL's default (reference forward in every step)"),
        ("dpo", "kiln-trimmed", "trl-precomputed", "DPO, diagnostic: Kiln batches cut to their longest row"),
    ]
    for stage, a, b, label in pairs:
        ra, rb = results[(stage, a)], results[(stage, b)]
        print(
            f"  {label:72} {ra['examples_per_s'] / rb['examples_per_s']:5.2f}x examples/s, "
            f"{ra['tokens_per_s'] / rb['tokens_per_s']:5.2f}x tokens/s"
        )


if __name__ == "__main__":
    main()
