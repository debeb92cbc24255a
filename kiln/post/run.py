"""Drivers of the post-training stages: data -> batch source -> the spine's Trainer -> accuracy."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch

from kiln.post import stages as S
from kiln.post.sources import ExampleSource, OnlineSource


def _trainer(
    recipe, out: Path, stage_cfg, data, loss_fn, init: Path, resume: str, prepare_model=None, eval_loss_fn=None
):
    from kiln.checkpoint import read_manifest, resolve_checkpoint
    from kiln.model.weights import model_config_from_dict
    from kiln.recipe import recipe_to_dict
    from kiln.train.trainer import Trainer

    # The config alone: the Trainer loads (and checks) the weights from init_from itself.
    folder = resolve_checkpoint(init)
    model_cfg = model_config_from_dict(read_manifest(folder)["model_config"], str(folder))
    train_cfg = stage_cfg.train.train_config(recipe.train)
    return Trainer(
        model_cfg,
        train_cfg,
        None,
        out,
        recipe_dict=recipe_to_dict(recipe),
        resume=resume,
        init_from=init,
        loss_fn=loss_fn,
        data=data,
        parallel=recipe.parallel,
        prepare_model=prepare_model,
        eval_loss_fn=eval_loss_fn,
    )


def _peft(recipe):
    """The [peft] method applied to the stage's model after its weights load (None: full fine-tuning)."""
    cfg = getattr(recipe, "peft", None)
    if cfg is None or cfg.method == "none":
        return None
    from kiln.peft.apply import apply_peft

    return lambda model: apply_peft(model, cfg)


def _finish(trainer, tokenizer, heldout: list[dict], before: dict, out: Path, extra: dict, recipe=None) -> dict:
    summary = trainer.fit()
    after = S.task_accuracy(trainer.model, tokenizer, heldout)
    stats = {**extra, "train": summary, "heldout_before": before, "heldout_after": after}
    peft = getattr(recipe, "peft", None)
    if peft is not None and peft.method != "none" and trainer.is_main:
        stats["peft"] = _save_peft_outputs(trainer, peft, out)
    if trainer.is_main:
        S.write_stats(out, stats)
        print(
            f"[{out.name}] held-out task accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
            f"({', '.join(f'{k} {v:.2f}' for k, v in after['per_task'].items())})"
        )
    return stats


def _save_peft_outputs(trainer, peft, out: Path) -> dict:
    """The small trainable weights (PEFT format for LoRA/QLoRA, Kiln's own for adapters), and for
    LoRA/QLoRA the merged plain weights the next stage and `kiln export hf` start from."""
    from kiln.checkpoint import save_weights
    from kiln.peft.apply import parameter_counts
    from kiln.peft.peft_io import merged_state_dict, save_peft_adapter, save_trainable

    trainable, total = parameter_counts(trainer.model)
    if peft.method in ("lora", "qlora"):
        save_peft_adapter(trainer.model, trainer.model_cfg, out / "adapter", peft)
        save_weights(
            out / "merged",
            trainer.model_cfg,
            merged_state_dict(trainer.model),
            {"step": trainer.step, "peft": peft.method},
        )
    else:
        save_trainable(trainer.model, peft, out / "adapter")
    return {
        "method": peft.method,
        "trainable_params": trainable,
        "total_params": total,
        "adapter": str(out / "adapter"),
    }


def _baseline(init: Path, tokenizer, heldout: list[dict]) -> dict:
    from kiln.model.weights import load_model

    model, _ = load_model(init)
    return S.task_accuracy(model, tokenizer, heldout)


def run_sft(recipe, out: Path, init: Path, tokenizer, resume: str = "auto") -> dict:
    from kiln.post.tasks import task_sft_examples

    cfg = recipe.sft
    conversations, sources = [], {}
    if cfg.tasks:
        tasks = S.train_tasks(recipe.tasks)
        conversations += task_sft_examples(tasks)
        sources["tasks"] = len(tasks)
    if cfg.files:
        from kiln.post.data import read_sft

        examples, read_stats = read_sft(cfg.files)
        conversations += examples
        sources["files"] = read_stats
    heldout = S.heldout_tasks(recipe.tasks)
    seq_len = cfg.train.seq_len
    rows, row_stats = S.sft_rows(tokenizer, conversations, seq_len, cfg.packing)
    val_rows, _ = S.sft_rows(tokenizer, task_sft_examples(heldout), seq_len, cfg.packing)
    vocab = tokenizer.vocab_size
    train = ExampleSource(rows, cfg.train.micro_batch_size, seed=recipe.train.seed, vocab_size=vocab)
    val = ExampleSource(val_rows, cfg.train.micro_batch_size, shuffle=False, vocab_size=vocab)
    before = _baseline(init, tokenizer, heldout)
    trainer = _trainer(recipe, out, cfg, (train, val), S.sft_loss, init, resume, prepare_model=_peft(recipe))
    return _finish(trainer, tokenizer, heldout, before, out, {"data": {**sources, **row_stats}}, recipe)


def run_dpo(recipe, out: Path, init: Path, tokenizer, resume: str = "auto") -> dict:
    from kiln.model.weights import load_model
    from kiln.post.tasks import task_preference_pairs

    cfg = recipe.dpo
    precision = recipe.train.precision
    reference, _ = load_model(init)
    pair_stats = {}
    if cfg.files:
        from kiln.post.data import read_preferences

        pairs, _ = read_preferences(cfg.files)
    elif cfg.rejected == "policy":
        train_cfg = cfg.train.train_config(recipe.train)
        wanted = train_cfg.max_steps * (train_cfg.global_batch_tokens // train_cfg.seq_len)
        pairs, pair_stats = policy_pairs(
            reference, tokenizer, S.train_tasks(recipe.tasks), wanted, seed=recipe.tasks.seed
        )
    else:
        pairs = task_preference_pairs(S.train_tasks(recipe.tasks), seed=recipe.tasks.seed)
    heldout = S.heldout_tasks(recipe.tasks)
    seq_len = cfg.train.seq_len
    to_divergence = cfg.rejected_to_divergence
    rows = S.reference_logprobs(reference, S.pair_rows(tokenizer, pairs, seq_len, to_divergence), precision=precision)
    val_pairs = task_preference_pairs(heldout, seed=recipe.tasks.seed + 1)
    val_rows = S.reference_logprobs(
        reference, S.pair_rows(tokenizer, val_pairs, seq_len, to_divergence), precision=precision
    )
    before = S.task_accuracy(reference, tokenizer, heldout)
    del reference
    vocab = tokenizer.vocab_size
    train = ExampleSource(rows, cfg.train.micro_batch_size, seed=recipe.train.seed, vocab_size=vocab)
    val = ExampleSource(val_rows, cfg.train.micro_batch_size, shuffle=False, vocab_size=vocab)
    trainer = _trainer(recipe, out, cfg, (train, val), S.make_dpo_loss(cfg), init, resume, prepare_model=_peft(recipe))
    stats = _finish(trainer, tokenizer, heldout, before, out, {"pairs": len(rows), **pair_stats}, recipe)
    stats["heldout_preferences"] = preference_stats(trainer.model, val_rows, cfg.beta, precision)
    if trainer.is_main:
        S.write_stats(out, stats)
    return stats


def policy_pairs(
    model, tokenizer, tasks: list[dict], wanted: int, seed: int = 0, chunk: int = 256
) -> tuple[list, dict]:
    """On-policy preference pairs: chosen = the task's answer, rejected = the model's own greedy
    answer where the grader marks it wrong. Tasks are visited in a seeded order until `wanted` pairs
    exist (one pass of training), so the cost is bounded by what the stage will use. Problems the
    model already solves give no pair; if it solves every one, the distractor pairs stand in."""
    from kiln.data.chat import render_prompt
    from kiln.post.tasks import grade, task_preference_pairs, to_messages

    order = list(range(len(tasks)))
    random.Random(f"kiln-policy-pairs|{seed}").shuffle(order)
    pairs, asked = [], 0
    for start in range(0, len(order), chunk):
        batch = [tasks[i] for i in order[start : start + chunk]]
        prompts = [render_prompt(tokenizer, to_messages(ex, with_answer=False)) for ex in batch]
        completions = S.complete(model, tokenizer, prompts, max_new_tokens=16)
        asked += len(batch)
        for ex, ids in zip(batch, completions):
            text = tokenizer.decode(S.strip_stop(tokenizer, ids)).strip()
            if text and grade(ex, text) == 0.0:
                pairs.append((to_messages(ex, with_answer=False), ex["answer"], text))
        if len(pairs) >= wanted:
            break
    stats = {"rejected": "policy", "prompts_tried": asked, "policy_wrong": len(pairs)}
    if not pairs:
        print("[dpo] the starting model answers every task prompt tried correctly: using distractor pairs")
        return task_preference_pairs(tasks, seed=seed), {**stats, "rejected": "distractor"}
    return pairs, stats


@torch.no_grad()
def preference_stats(model, rows: list[tuple], beta: float, precision: str = "fp32") -> dict:
    """Implicit-reward accuracy and margin on held-out pairs: reward = beta * (policy - reference)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    correct, margins = 0, []
    for start in range(0, len(rows), 32):
        parts = [torch.stack(p) for p in zip(*rows[start : start + 32])]
        with S.autocast(precision, device):
            pol_c, pol_r = (x.cpu() for x in S._pair_logprobs(model, *(p.to(device) for p in parts[:4])))
        margin = beta * ((pol_c - parts[4]) - (pol_r - parts[5]))
        correct += int((margin > 0).sum())
        margins += margin.tolist()
    model.train(was_training)
    return {"reward_accuracy": correct / len(margins), "mean_reward_margin": sum(margins) / len(margins)}


def rl_prompts(recipe) -> list[dict]:
    """GRPO's prompt pool: [tasks] train-split problems, drawn with grpo.prompt_seed when it is set
    (problems SFT did not see; the split hash keeps them out of the held-out set either way)."""
    seed = recipe.grpo.prompt_seed
    return S.train_tasks(recipe.tasks if seed is None else dataclasses.replace(recipe.tasks, seed=seed))


def run_grpo(recipe, out: Path, init: Path, tokenizer, resume: str = "auto") -> dict:
    from kiln.data.chat import render_prompt
    from kiln.post.losses import group_advantages
    from kiln.post.tasks import grade

    cfg = recipe.grpo
    prompts = rl_prompts(recipe)
    heldout = S.heldout_tasks(recipe.tasks)
    before = _baseline(init, tokenizer, heldout)
    pad = tokenizer.token_id("<|pad|>")
    holder = {}
    rollout_stats = {"rollouts": 0, "reward_sum": 0.0}
    judge = None
    if cfg.reward_model:
        from kiln.post.ppo import model_reward
        from kiln.post.rm import load_scalar_model

        judge = model_reward(load_scalar_model(cfg.reward_model, key="grpo.reward_model"), tokenizer)

    def make_batch(seed: int) -> tuple[torch.Tensor, ...]:
        """Sample group_size completions for prompts_per_step prompts from the current policy and
        score them with the task graders; the batch carries tokens, targets (completion only) and
        each sequence's group-normalised advantage."""
        rng = random.Random(seed)
        picked = [prompts[rng.randrange(len(prompts))] for _ in range(cfg.prompts_per_step)]
        model = holder["model"]
        prompt_ids = [render_prompt(tokenizer, [{"role": "user", "content": ex["prompt"]}]) for ex in picked]
        expanded = [p for p in prompt_ids for _ in range(cfg.group_size)]
        was_training = model.training
        model.eval()
        completions = S.complete(model, tokenizer, expanded, cfg.max_new_tokens, temperature=cfg.temperature, seed=seed)
        model.train(was_training)
        if judge is not None:
            rewards = torch.as_tensor(
                judge([picked[i // cfg.group_size] for i in range(len(completions))], expanded, completions)
            ).float()
        else:
            rewards = torch.tensor(
                [
                    grade(picked[i // cfg.group_size], tokenizer.decode(S.strip_stop(tokenizer, c)))
                    for i, c in enumerate(completions)
                ]
            )
        rollout_stats["rollouts"] += len(completions)
        rollout_stats["reward_sum"] += float(rewards.sum())
        advantages = group_advantages(rewards, cfg.group_size)
        seq_len = cfg.train.seq_len
        inputs, targets = [], []
        for p, c in zip(expanded, completions):
            ids = (p + c)[: seq_len + 1]  # c ends with <|end|> when the policy stopped by itself
            target = [S.IGNORE if i < len(p) - 1 else t for i, t in enumerate(ids[1:])]
            inputs.append(S._pad(ids[:-1], seq_len, pad))
            targets.append(S._pad(target, seq_len, S.IGNORE))
        return torch.tensor(inputs), torch.tensor(targets), advantages.float()

    def loss_fn(model, batch):
        from kiln.post.losses import grpo_loss, token_logprobs

        inputs, targets, advantages = batch
        logits = model(inputs)
        logp = token_logprobs(logits, targets, temperature=cfg.temperature)  # as the rollouts were sampled
        mask = targets != S.IGNORE
        # One optimisation pass per rollout batch: the sampling policy is the current one, so the
        # old log-probs are the current ones detached (ratio 1, the clip inactive but kept general).
        loss, _ = grpo_loss(logp, logp.detach(), advantages, mask, eps=cfg.clip_eps, beta=0.0, loss_type=cfg.loss_type)
        return loss, inputs.shape[0]

    val_rows = [
        S.sft_rows(
            tokenizer,
            [[{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": ex["answer"]}]],
            cfg.train.seq_len,
            False,
        )[0][0]
        for ex in heldout[:64]
    ]
    val_batches = [tuple(torch.stack(p) for p in zip(*val_rows[i : i + 16])) for i in range(0, len(val_rows), 16)]

    source = OnlineSource(make_batch, seed=recipe.train.seed, val_batches=val_batches, vocab_size=tokenizer.vocab_size)
    trainer = _trainer(
        recipe, out, cfg, (source, source), loss_fn, init, resume, prepare_model=_peft(recipe), eval_loss_fn=S.sft_loss
    )  # validation: the SFT loss of the reference answers
    holder["model"] = trainer.model
    stats = _finish(trainer, tokenizer, heldout, before, out, {"rollout": rollout_stats}, recipe)
    return stats


# The other stages live in their own modules; the pipeline finds every stage's run_<name> here.
from kiln.post.distill import run_distill  # noqa: E402
from kiln.post.ppo import run_ppo  # noqa: E402
from kiln.post.rm import run_rm  # noqa: E402

__all__ = ["run_sft", "run_dpo", "run_grpo", "run_rm", "run_ppo", "run_distill"]
