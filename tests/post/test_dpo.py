"""The DPO stage's parts around the loss: the RPO-style NLL term, reference log-probs computed under
the policy's autocast (so the margin starts at zero), and on-policy pairs whose rejected answer is
the model's own wrong greedy answer."""

import math

import pytest
import torch
import torch.nn.functional as F

from kiln.data.chat import render_prompt
from kiln.model import build_model
from kiln.post import dpo
from kiln.post.config import DPOConfig
from kiln.post.evaluate import complete, strip_stop
from kiln.post.losses import sequence_logprobs
from kiln.post.rows import IGNORE
from kiln.post.tasks import generate_tasks, grade, task_preference_pairs
from kiln.train.precision import autocast


def _model(model_cfg):
    torch.manual_seed(0)
    return build_model(model_cfg())


def _batch(tok, n=6):
    tasks = generate_tasks("sort", n, seed=11)
    rows = dpo.pair_rows(tok, task_preference_pairs(tasks, seed=1), 48)
    return [torch.stack(p) for p in zip(*rows)], rows


def test_nll_weight_adds_the_per_token_nll_of_the_chosen_answers(tok, model_cfg):
    model = _model(model_cfg)
    parts, _ = _batch(tok)
    batch = (*parts, torch.zeros(len(parts[0])), torch.zeros(len(parts[0])))
    plain = dpo.make_dpo_loss(DPOConfig())(model, batch)[0]
    mixed = dpo.make_dpo_loss(DPOConfig(nll_weight=0.5))(model, batch)[0]
    chosen, chosen_t = parts[0], parts[1]
    nll = F.cross_entropy(model(chosen).flatten(0, 1), chosen_t.flatten(), ignore_index=IGNORE)
    torch.testing.assert_close(mixed - plain, 0.5 * nll, rtol=1e-4, atol=1e-5)


def test_reference_logprobs_under_the_policy_autocast_start_the_margin_at_zero(tok, model_cfg):
    model = _model(model_cfg)
    parts, rows = _batch(tok)
    ref16 = [torch.stack(p) for p in zip(*dpo.reference_logprobs(model, rows, precision="bf16"))]
    ref32 = [torch.stack(p) for p in zip(*dpo.reference_logprobs(model, rows, precision="fp32"))]
    # beta 1 rather than 0.1: the margin bf16 rounding leaves scales with beta, and at 0.1 it can
    # fall under the 1e-6 the loss is read to (it did for one initial draw).
    loss_fn = dpo.make_dpo_loss(DPOConfig(beta=1.0))
    with autocast("bf16"):  # what the training loop wraps the loss in under precision = "bf16"
        same = loss_fn(model, tuple(ref16))[0]
        mixed = loss_fn(model, tuple(ref32))[0]
    # Margin exactly zero: the sigmoid loss is log 2 at step 0.
    assert same.item() == pytest.approx(math.log(2), abs=1e-6)
    # fp32 references under a bf16 policy are off by bf16 rounding: the bug this guards against.
    assert not torch.equal(ref16[4], ref32[4])
    assert mixed.item() != pytest.approx(math.log(2), abs=1e-6)


def test_policy_pairs_reject_the_models_own_wrong_answers(tok, model_cfg):
    model = _model(model_cfg).eval()
    tasks = generate_tasks("reverse", 40, seed=2)
    pairs, stats = dpo.policy_pairs(model, tok, tasks, wanted=5, chunk=8)
    # An untrained model is wrong everywhere: the first chunk gives enough pairs and the search stops.
    assert stats == {"rejected": "policy", "prompts_tried": 8, "policy_wrong": 8} and len(pairs) == 8
    by_prompt = {t["prompt"]: t for t in tasks}
    for messages, chosen, rejected in pairs:
        ex = by_prompt[messages[0]["content"]]
        assert chosen == ex["answer"] and grade(ex, rejected) == 0.0
        greedy = complete(model, tok, [render_prompt(tok, messages)], 16)[0]
        assert rejected == tok.decode(strip_stop(tok, greedy)).strip()


def test_policy_pairs_fall_back_to_distractors_when_the_model_is_always_right(tok, monkeypatch):
    tasks = generate_tasks("sort", 10, seed=4)
    answer_of = {tuple(render_prompt(tok, [{"role": "user", "content": t["prompt"]}])): t["answer"] for t in tasks}

    def always_right(model, tokenizer, prompts, max_new_tokens, **_):
        return [tokenizer.encode(answer_of[tuple(p)]) for p in prompts]

    monkeypatch.setattr(dpo, "complete", always_right)
    pairs, stats = dpo.policy_pairs(None, tok, tasks, wanted=4, chunk=4)
    assert stats["rejected"] == "distractor" and stats["prompts_tried"] == 10
    assert pairs == task_preference_pairs(tasks, seed=0)


def test_rejected_to_divergence_scores_the_rejected_answer_up_to_its_first_wrong_token(tok, model_cfg):
    prompt = [{"role": "user", "content": "Reverse: sun dog cat"}]
    pairs = [(prompt, "cat dog sun", "cat sun dog")]
    ((c, ct, r, rt),) = dpo.pair_rows(tok, pairs, 48)
    ((c2, ct2, r2, rt2),) = dpo.pair_rows(tok, pairs, 48, rejected_to_divergence=True)
    assert torch.equal(c, c2) and torch.equal(ct, ct2) and torch.equal(r, r2)  # chosen untouched
    first = int((c != r).nonzero()[0])  # the first input id where the answers part
    kept = (rt2 != IGNORE).nonzero().flatten().tolist()
    # The rejected side keeps the answer tokens up to and including the prediction of that id.
    assert kept == [j for j in (rt != IGNORE).nonzero().flatten().tolist() if j < first]
    assert kept[-1] == first - 1 and rt2[first - 1] == r[first]
    # The shared prefix scores the same on both sides: only the first wrong token is left in the margin.
    model = _model(model_cfg)
    logits_c, logits_r = model(c[None]), model(r[None])
    shared = (rt2 != IGNORE) & (torch.arange(48) < first - 1)
    torch.testing.assert_close(
        sequence_logprobs(logits_c, torch.where(shared, ct, IGNORE)[None]),
        sequence_logprobs(logits_r, torch.where(shared, rt2, IGNORE)[None]),
    )
