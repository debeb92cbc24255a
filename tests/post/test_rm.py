"""`kiln rm`: the scalar head, the reward read at the last real token, the Bradley-Terry objective,
and the stage learning to rank correct task answers over wrong ones on held-out pairs."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from kiln.checkpoint import read_manifest, save_weights
from kiln.data.chat import render_prompt
from kiln.errors import ConfigError
from kiln.model import build_model
from kiln.post.config import RMConfig, StageTrainConfig, TaskConfig
from kiln.post.driver import run_stage
from kiln.post.rm import (
    HEAD,
    attach_scalar_head,
    load_scalar_model,
    make_rm_loss,
    model_reward,
    preference_accuracy,
    rm_rows,
    sequence_scores,
)
from kiln.post.tasks import generate_tasks, heldout_tasks, task_preference_pairs
from kiln.recipe import Recipe


def make_recipe(families, rm: RMConfig, train_per_family=400, heldout_per_family=100):
    recipe = Recipe()
    recipe.train = dataclasses.replace(recipe.train, precision="fp32", peak_flops=1e12, log_every=10)
    recipe.tasks = TaskConfig(
        families=families, train_per_family=train_per_family, heldout_per_family=heldout_per_family
    )
    recipe.rm = rm
    return recipe


@pytest.mark.parametrize("tied", [False, True])
def test_scalar_head_gives_one_value_per_token(tok, model_cfg, tied):
    model = build_model(model_cfg(tie_embeddings=tied))
    embeddings = model.tok_embeddings.weight.detach().clone()
    head = attach_scalar_head(model)
    ids = torch.randint(16, tok.vocab_size, (3, 10))
    values = model(ids)
    assert values.shape == (3, 10, 1)
    state = model.state_dict()
    assert state["output.weight"].shape == (1, 32) and state["output.weight"].data_ptr() == head.weight.data_ptr()
    assert torch.equal(state["tok_embeddings.weight"], embeddings)  # a tied model's embeddings stay put
    # The head reads the final normed hidden state, as the vocabulary head did.
    assert torch.allclose(values[..., 0], (model.norm(_hidden(model, ids)) @ head.weight.T)[..., 0], atol=1e-5)


def _hidden(model, ids):
    x = model.tok_embeddings(ids)
    cos = model.rope_cos[: ids.shape[1]].unsqueeze(1)
    sin = model.rope_sin[: ids.shape[1]].unsqueeze(1)
    for block in model.layers:
        x = block(x, cos, sin)
    return x


def test_reward_is_read_at_the_last_real_token(tok, model_cfg):
    model = build_model(model_cfg())
    attach_scalar_head(model)
    pairs = task_preference_pairs(generate_tasks("sort", 6, seed=1))
    rows, cut = rm_rows(tok, pairs, seq_len=48)
    assert cut == 0
    chosen, last = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    end = tok.token_id("<|end|>")
    assert all(chosen[i, last[i]] == end for i in range(len(rows)))  # the closing <|end|> is scored
    assert all((chosen[i, last[i] + 1 :] == tok.token_id("<|pad|>")).all() for i in range(len(rows)))
    scores = sequence_scores(model, chosen, last)
    alone = [model(chosen[i : i + 1, : last[i] + 1])[0, -1, 0] for i in range(len(rows))]
    assert torch.allclose(scores, torch.stack(alone), atol=1e-5)
    # More padding changes nothing: causal attention keeps it away from the scored token.
    wider = F.pad(chosen, (0, 10), value=tok.token_id("<|pad|>"))
    assert torch.allclose(sequence_scores(model, wider, last), scores, atol=1e-5)


def test_loss_is_bradley_terry_with_margin(tok, model_cfg):
    model = build_model(model_cfg())
    attach_scalar_head(model)
    torch.nn.init.normal_(model.output.weight, std=0.5)  # scores far enough apart for the margin to matter
    rows, _ = rm_rows(tok, task_preference_pairs(generate_tasks("reverse", 8, seed=2)), seq_len=48)
    batch = tuple(torch.stack(p) for p in zip(*rows))
    loss, counted = make_rm_loss(RMConfig(margin=0.5))(model, batch)
    assert counted == 8
    rc = torch.stack([model(r[0][None, : r[1] + 1])[0, -1, 0] for r in rows])
    rr = torch.stack([model(r[2][None, : r[3] + 1])[0, -1, 0] for r in rows])
    expected = -torch.log(torch.sigmoid(rc - rr - 0.5)).mean()
    assert torch.allclose(loss, expected, atol=1e-5)
    plain, _ = make_rm_loss(RMConfig())(model, batch)
    assert plain < loss  # the margin asks for more than winning


def test_rm_learns_to_rank_correct_over_wrong(tok, model_cfg, tmp_path):
    torch.manual_seed(0)
    cfg = model_cfg()
    save_weights(tmp_path / "init", cfg, build_model(cfg).state_dict())
    rm = RMConfig(
        train=StageTrainConfig(
            lr=1e-3, max_steps=40, warmup_steps=2, seq_len=32, micro_batch_size=16, eval_every=20, ckpt_every=20
        )
    )
    stats = run_stage("rm", make_recipe(["sort"], rm), tmp_path / "rm", tmp_path / "init", tok, resume="none")
    before, after = stats["before"]["heldout"], stats["after"]["heldout"]
    assert after["pairs"] == 100
    # Measured: 0.55 -> 0.78 (sorted answer over a shuffled or reversed one).
    assert after["accuracy"] > 0.65 and after["accuracy"] > before["accuracy"] + 0.1
    assert after["mean_margin"] > 0
    assert json.loads((tmp_path / "rm" / "stats.json").read_text())["after"]["heldout"] == after

    # The export records its head and reloads into the same scores, for PPO's reward or critic.
    export = tmp_path / "rm" / "reward_model"
    assert read_manifest(export)["head"]["kind"] == "scalar"
    reloaded = load_scalar_model(tmp_path / "rm")
    recipe = make_recipe(["sort"], rm)
    rows, _ = rm_rows(tok, task_preference_pairs(heldout_tasks(recipe.tasks), seed=recipe.tasks.seed + 1), seq_len=32)
    assert preference_accuracy(reloaded, rows) == pytest.approx(after)
    # A training checkpoint of the stage is recognised by the head's shape.
    assert load_scalar_model(tmp_path / "rm" / "checkpoints").output.weight.shape == (1, 32)


def test_pairs_from_files_hold_some_out_and_quarantine_bad_lines(tok, model_cfg, tmp_path):
    torch.manual_seed(0)
    cfg = model_cfg()
    save_weights(tmp_path / "init", cfg, build_model(cfg).state_dict())
    pairs = task_preference_pairs(generate_tasks("sort", 60, seed=4))
    lines = [json.dumps({"prompt": p[0]["content"], "chosen": c, "rejected": r}) for p, c, r in pairs]
    lines.insert(7, json.dumps({"prompt": "no answers here"}))
    (tmp_path / "prefs.jsonl").write_text("\n".join(lines) + "\n")
    rm = RMConfig(
        files=[str(tmp_path / "prefs.jsonl")],
        heldout_fraction=0.1,
        train=StageTrainConfig(max_steps=2, warmup_steps=0, seq_len=32, micro_batch_size=8, eval_every=2, ckpt_every=2),
    )
    stats = run_stage(
        "rm", make_recipe(["sort"], rm, heldout_per_family=10), tmp_path / "rm", tmp_path / "init", tok, resume="none"
    )
    assert stats["data"]["pairs"] == 54 and stats["data"]["heldout_pairs"] == 6
    assert stats["data"]["files"]["rejected"] == 1
    assert len((tmp_path / "rm" / "rejected.jsonl").read_text().splitlines()) == 1
    assert stats["after"]["heldout_tasks"]["pairs"] == 10  # the task pairs are reported as well


def test_language_model_is_not_a_reward_model(tok, model_cfg, tmp_path):
    cfg = model_cfg()
    save_weights(tmp_path / "lm", cfg, build_model(cfg).state_dict())
    with pytest.raises(ConfigError, match="ppo.reward: .*not a reward model"):
        load_scalar_model(tmp_path / "lm", key="ppo.reward")
    with pytest.raises(ConfigError, match="ppo.reward: .*no such checkpoint"):
        load_scalar_model(tmp_path / "missing", key="ppo.reward")


@pytest.mark.parametrize(
    "change, key",
    [
        ({"margin": -1.0}, "rm.margin"),
        ({"heldout_fraction": 0.0}, "rm.heldout_fraction"),
        ({"train": StageTrainConfig(lr=0.0)}, "rm.train.lr"),
    ],
)
def test_config_errors_name_the_key(tok, tmp_path, change, key):
    with pytest.raises(ConfigError) as err:
        run_stage("rm", make_recipe(["sort"], RMConfig(**change)), tmp_path / "rm", tmp_path / "init", tok)
    assert err.value.key == key


def test_learned_reward_model_scores_the_last_token(tok, model_cfg, tmp_path):
    cfg = model_cfg()
    rm = build_model(cfg)
    attach_scalar_head(rm)
    save_weights(tmp_path / "rm", cfg, rm.state_dict(), {"head": HEAD})
    loaded = load_scalar_model(tmp_path / "rm")
    examples = generate_tasks("arithmetic", 5, seed=1)
    prompts = [render_prompt(tok, [{"role": "user", "content": e["prompt"]}]) for e in examples]
    completions = [[40 + i] * (i + 1) + [tok.token_id("<|end|>")] for i in range(5)]  # different lengths
    scores = model_reward(loaded, tok, batch_size=2)(examples, prompts, completions)
    expected = [
        sequence_scores(rm, torch.tensor([p + c]), torch.tensor([len(p + c) - 1])) for p, c in zip(prompts, completions)
    ]
    assert torch.allclose(scores, torch.cat(expected), atol=1e-5)
