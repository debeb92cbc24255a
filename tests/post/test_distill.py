"""`kiln distill`: the objective against an independent KL, both KL directions pulling the student
towards the teacher, and the stage (teacher-generated data + soft targets) lowering the held-out
KL(teacher || student)."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from kiln.checkpoint import save_weights
from kiln.errors import ConfigError
from kiln.model import build_model
from kiln.post.config import DistillConfig, StageTrainConfig, TaskConfig
from kiln.post.distill import make_distill_loss, teacher_conversations, teacher_kl
from kiln.post.driver import run_stage
from kiln.post.rows import sft_rows
from kiln.post.sft import sft_loss
from kiln.post.tasks import generate_tasks
from kiln.recipe import Recipe


def pair(model_cfg):
    """A student (small init) and a teacher (large init: peaked, prompt-dependent distributions)."""
    torch.manual_seed(0)
    student = build_model(model_cfg())
    torch.manual_seed(1)
    teacher = build_model(model_cfg(init_std=0.3)).requires_grad_(False)
    return student, teacher


def teacher_rows(tok, teacher, n=32, seed=1, packing=False):
    examples = generate_tasks("arithmetic", n, seed=seed)
    conversations, _ = teacher_conversations(teacher, tok, examples, DistillConfig(teacher="t", max_new_tokens=8))
    rows, _ = sft_rows(tok, conversations, 32, packing)
    return rows


def test_forward_kl_matches_torch_kl_div_and_alpha_zero_is_sft(tok, model_cfg):
    student, teacher = pair(model_cfg)
    rows = teacher_rows(tok, teacher, n=8, packing=True)
    batch = tuple(torch.stack(p) for p in zip(*rows))
    inputs, targets, positions, documents = batch
    loss, counted = make_distill_loss(DistillConfig(teacher="t", alpha=1.0), teacher)(student, batch)
    valid = targets != -100
    assert counted == int(valid.sum())
    log_s = F.log_softmax(student(inputs, position_ids=positions, document_ids=documents)[valid], -1)
    log_t = F.log_softmax(teacher(inputs, position_ids=positions, document_ids=documents)[valid], -1)
    reference = F.kl_div(log_s, log_t, log_target=True, reduction="batchmean")  # KL(teacher || student)
    assert torch.allclose(loss, reference, atol=1e-5)
    assert teacher_kl(student, teacher, rows) == pytest.approx(reference.item(), rel=1e-5)
    sft, sft_count = make_distill_loss(DistillConfig(teacher="t", alpha=0.0), teacher)(student, batch)
    assert torch.equal(sft, sft_loss(student, batch)[0]) and sft_count == counted


@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_both_directions_pull_the_student_towards_the_teacher(tok, model_cfg, kind):
    student, teacher = pair(model_cfg)
    rows = teacher_rows(tok, teacher)
    batch = tuple(torch.stack(p) for p in zip(*rows))
    loss_fn = make_distill_loss(DistillConfig(teacher="t", kind=kind, alpha=1.0), teacher)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss, _ = loss_fn(student, batch)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.8 * losses[0]  # the KL in the chosen direction falls


def make_recipe(distill: DistillConfig):
    recipe = Recipe()
    recipe.train = dataclasses.replace(recipe.train, precision="fp32", peak_flops=1e12, log_every=10)
    recipe.tasks = TaskConfig(families=["arithmetic"], train_per_family=200, heldout_per_family=16)
    recipe.distill = distill
    return recipe


def save_pair(model_cfg, root):
    student, teacher = pair(model_cfg)
    save_weights(root / "init", student.cfg, student.state_dict())
    save_weights(root / "teacher", teacher.cfg, teacher.state_dict())


def test_distill_stage_lowers_heldout_kl_to_the_teacher(tok, model_cfg, tmp_path):
    save_pair(model_cfg, tmp_path)
    # alpha 0.9: mostly soft targets. With alpha 0.5 the cross entropy on the teacher's greedy answers
    # sharpens the student beyond the teacher and the KL rises again after ~20 steps (measured 1.37 ->
    # 1.49 at 40 steps); the soft targets alone bring it down (1.37 -> 1.10 here).
    cfg = DistillConfig(
        teacher=str(tmp_path / "teacher"),
        max_new_tokens=8,
        alpha=0.9,
        train=StageTrainConfig(
            lr=1e-2,
            max_steps=20,
            warmup_steps=0,
            seq_len=32,
            micro_batch_size=16,
            eval_every=20,
            eval_batches=1,
            ckpt_every=20,
        ),
    )
    stats = run_stage("distill", make_recipe(cfg), tmp_path / "d", tmp_path / "init", tok, resume="none")
    before, after = stats["heldout_before"]["teacher_kl"], stats["heldout_after"]["teacher_kl"]
    assert after < 0.9 * before
    assert stats["data"]["generated"] == 200 and stats["data"]["kept"] == 200
    assert "accuracy" in stats["heldout_after"] and "accuracy" in stats["teacher"]["heldout"]
    lines = (tmp_path / "d" / "teacher_data.jsonl").read_text().splitlines()
    assert len(lines) == 200 and json.loads(lines[0])["messages"][-1]["role"] == "assistant"
    assert json.loads((tmp_path / "d" / "stats.json").read_text())["heldout_after"]["teacher_kl"] == after


def test_nothing_left_after_filtering_is_an_error(tok, model_cfg, tmp_path):
    save_pair(model_cfg, tmp_path)  # a random teacher sorts no list correctly
    cfg = DistillConfig(teacher=str(tmp_path / "teacher"), max_new_tokens=4, filter_correct=True)
    recipe = make_recipe(cfg)
    recipe.tasks = dataclasses.replace(recipe.tasks, families=["sort"], train_per_family=20)
    with pytest.raises(ConfigError) as err:
        run_stage("distill", recipe, tmp_path / "d", tmp_path / "init", tok)
    assert err.value.key == "distill.filter_correct"


def test_teacher_with_another_vocabulary_is_refused(tok, model_cfg, tmp_path):
    save_pair(model_cfg, tmp_path)
    small = build_model(model_cfg(vocab_size=300))
    save_weights(tmp_path / "other", small.cfg, small.state_dict())
    with pytest.raises(ConfigError, match="distill.teacher: .*share the tokenizer"):
        run_stage(
            "distill",
            make_recipe(DistillConfig(teacher=str(tmp_path / "other"))),
            tmp_path / "d",
            tmp_path / "init",
            tok,
        )
    with pytest.raises(ConfigError, match="distill.teacher: .*no such checkpoint"):
        run_stage(
            "distill",
            make_recipe(DistillConfig(teacher=str(tmp_path / "missing"))),
            tmp_path / "d",
            tmp_path / "init",
            tok,
        )


@pytest.mark.parametrize(
    "change, key",
    [
        ({"teacher": ""}, "distill.teacher"),
        ({"kind": "jsd"}, "distill.kind"),
        ({"alpha": 1.5}, "distill.alpha"),
        ({"data": "web"}, "distill.data"),
        ({"samples_per_prompt": 2}, "distill.samples_per_prompt"),
    ],
)
def test_config_errors_name_the_key(tok, tmp_path, change, key):
    with pytest.raises(ConfigError) as err:
        run_stage(
            "distill",
            make_recipe(DistillConfig(**{"teacher": "somewhere", **change})),
            tmp_path / "d",
            tmp_path / "init",
            tok,
        )
    assert err.value.key == key
