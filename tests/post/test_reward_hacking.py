"""Reward-hacking controls (kiln.post.reward_controls), each against a planted hack: a reward that a
degenerate output games.

- an ensemble with one hackable head (it rewards a repeated token): `min` and `mean_minus_std` give the
  degenerate output a low reward where `mean` ranks it first;
- a reward that grows with the number of tokens: the length penalty caps the growth, in PPO's
  rollout scores and in GRPO's group advantages;
- a reward model trained to prefer a degenerate answer: one refresh on fresh degenerate samples
  labelled by the task verifier lowers its score on that output below the right answer.
Plus the multi-head reward model's bootstrap loss on worked numbers, one short rm -> grpo -> ppo run with
every control on, and the refusals (the [grpo] config errors are in test_grpo.py)."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.checkpoint import read_manifest, save_weights
from kiln.data.chat import render_prompt
from kiln.errors import ConfigError
from kiln.model import build_model
from kiln.post.config import GRPOConfig, PPOConfig, RMConfig, StageTrainConfig, TaskConfig
from kiln.post.driver import run, run_stage
from kiln.post.grpo import GRPO
from kiln.post.losses import group_advantages
from kiln.post.ppo import PPO, make_rollout
from kiln.post.reward_controls import REFRESH_DIR, ShapedReward, aggregate_heads, gold_pairs
from kiln.post.rm import attach_scalar_head, bootstrap_weights, head_scores, load_scalar_model, pair_loss, rm_rows
from kiln.post.tasks import generate_tasks, task_preference_pairs
from kiln.recipe import Recipe


class CountingRM(nn.Module):
    """A planted reward model: at each position, features = (tokens so far, repeats of `token` so
    far); `output` maps them to the heads' values, so the reward is read at the last token exactly
    as a Transformer reward model's is."""

    def __init__(self, token: int, weights: list[list[float]]):
        super().__init__()
        self.token = token
        self.output = nn.Linear(2, len(weights), bias=False)
        with torch.no_grad():
            self.output.weight.copy_(torch.tensor(weights))

    def forward(self, ids):
        counts = torch.ones_like(ids).cumsum(1).float()
        repeats = (ids == self.token).cumsum(1).float()
        return self.output(torch.stack([counts, repeats], -1))


def _prompt(tok):
    example = generate_tasks("sort", 1, seed=5)[0]
    return example, render_prompt(tok, [{"role": "user", "content": example["prompt"]}])


# ---- ensemble aggregation --------------------------------------------------------------------------


def test_aggregation_on_worked_numbers():
    scores = torch.tensor([[1.0, 2.0, 3.0], [6.0, 0.0, 0.0]])
    assert aggregate_heads(scores, "mean").tolist() == [2.0, 2.0]
    assert aggregate_heads(scores, "min").tolist() == [1.0, 0.0]
    # population std: sqrt(2/3) = 0.8165 and sqrt(8) = 2.8284; lambda 0.5
    uwo = aggregate_heads(scores, "mean_minus_std", 0.5)
    assert torch.allclose(uwo, torch.tensor([2 - 0.5 * (2 / 3) ** 0.5, 2 - 0.5 * 8**0.5]))


def test_one_hackable_head_is_outvoted_by_min_and_mean_minus_std(tok):
    example, prompt = _prompt(tok)
    answer = tok.encode(str(example["answer"]), parse_special=False)
    repeat = next(t for t in range(20, tok.vocab_size) if t not in prompt + answer)
    degenerate = [repeat] * 6
    # Head 0 is hackable: +3 per repeated token. Heads 1 and 2 (the sound ones) take 1 per repeat off
    # and give 0.1 per token; the answer scores the same on every head.
    weights = [[0.1, 3.0], [0.1, -1.0], [0.1, -1.0]]
    rm = CountingRM(repeat, weights)
    completions = [degenerate, answer]
    rewards, spread = {}, {}
    for mode, lam in (("mean", 0.0), ("min", 0.0), ("mean_minus_std", 1.0)):
        cfg = PPOConfig(reward="rm", reward_ensemble=mode, uncertainty_penalty=lam)
        shaped = ShapedReward(cfg, tok, "ppo.reward", model=rm)
        rewards[mode] = shaped([example] * 2, [prompt] * 2, completions)
        spread[mode] = shaped.stats["rm_std"]
    n = len(prompt)
    base = 0.1 * (n + 6)
    # mean: (3 - 1 - 1) / 3 per repeat: the degenerate output gains 2 over the answer and wins
    assert rewards["mean"][0] > rewards["mean"][1]
    assert rewards["min"][0] < rewards["min"][1] and rewards["mean_minus_std"][0] < rewards["mean_minus_std"][1]
    assert rewards["min"][0].item() == pytest.approx(base - 6.0, abs=1e-4)
    # The answer's heads agree; the degenerate output's differ by d = 4 * 6 (head 0 vs 1 and 2), a
    # population std of d * sqrt(2) / 3: the batch mean is half of it.
    assert spread["mean"] == pytest.approx(24 * 2**0.5 / 3 / 2, rel=1e-4)


# ---- length control --------------------------------------------------------------------------------


def _length_loving(tok):
    return CountingRM(tok.token_id("<|pad|>"), [[0.5, 0.0]])  # +0.5 per token: longer always wins


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_length_penalty_caps_a_length_loving_reward_in_grpo_advantages(tok, alpha):
    example, prompt = _prompt(tok)
    lengths = [2, 4, 8, 12]
    completions = [[20 + i for i in range(n)] for n in lengths]
    target = 4
    cfg = GRPOConfig(reward_model="rm", length_penalty=alpha, length_target=target if alpha else 0)
    shaped = ShapedReward(cfg, tok, "grpo.reward_model", model=_length_loving(tok))
    rewards = shaped([example] * 4, [prompt] * 4, completions)
    raw = torch.tensor([0.5 * (len(prompt) + n) for n in lengths])
    expected = raw - alpha * (torch.tensor(lengths) - target).clamp_min(0)
    assert torch.allclose(rewards, expected)
    best = group_advantages(rewards, 4).argmax().item()
    if alpha:
        # 1.0 off per token beyond 4 outweighs the +0.5 the reward gives it: the target length wins.
        assert lengths[best] == target
        assert shaped.stats["length_penalty"] == pytest.approx((0 + 0 + 4 + 8) / 4)
        assert shaped.stats["length_tokens"] == pytest.approx(6.5)
    else:
        assert lengths[best] == 12 and "length_penalty" not in shaped.stats


def test_length_penalty_lowers_ppo_scores_by_alpha_per_token_over_target(tok, model_cfg):
    torch.manual_seed(0)
    cfg = model_cfg(init_std=0.3)
    reference = build_model(cfg).eval()
    critic = build_model(cfg)
    attach_scalar_head(critic)
    examples = generate_tasks("sort", 4, seed=2)
    prompts = [render_prompt(tok, [{"role": "user", "content": e["prompt"]}]) for e in examples]
    rollouts = {}
    for alpha in (0.0, 0.25):
        ppo = PPOConfig(
            reward="rm", max_new_tokens=6, kl_coef=0.0, length_penalty=alpha, length_target=2 if alpha else 0
        )
        shaped = ShapedReward(ppo, tok, "ppo.reward", model=_length_loving(tok))
        rollouts[alpha] = make_rollout(reference, critic, reference, tok, examples, prompts, shaped, ppo, 64, seed=4)
    plain, capped = rollouts[0.0], rollouts[0.25]
    assert torch.equal(plain.targets, capped.targets)
    end = {tok.token_id("<|end|>"), tok.eot_id}
    lengths = []
    for row in plain.targets:
        ids = [t for t in row.tolist() if t >= 0]
        lengths.append(len(ids) - (ids[-1] in end))
    expected = plain.scores - 0.25 * (torch.tensor(lengths, dtype=torch.float32) - 2).clamp_min(0)
    assert max(lengths) > 2 and torch.allclose(capped.scores, expected)


# ---- refresh ---------------------------------------------------------------------------------------


def _hacked_rm(tok, model_cfg, examples, prompts, degenerate):
    """A real reward model trained to score the degenerate completion above each right answer."""
    torch.manual_seed(0)
    model = build_model(model_cfg())
    attach_scalar_head(model, 2)
    # The verifier's pairs (answer over degenerate sample), turned round: the hack is learned.
    rows = [
        (bad, bad_last, good, good_last)
        for good, good_last, bad, bad_last in gold_pairs(tok, examples, prompts, [degenerate] * len(prompts))
    ]
    assert len(rows) == len(examples)
    batch = tuple(torch.stack(parts) for parts in zip(*rows))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(15):
        loss = pair_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), batch


def test_refresh_on_verifier_labelled_samples_unlearns_the_hack(tok, model_cfg, tmp_path):
    examples = generate_tasks("sort", 6, seed=7)
    prompts = [render_prompt(tok, [{"role": "user", "content": e["prompt"]}]) for e in examples]
    degenerate = [tok.encode("a", parse_special=False)[0]] * 5 + [tok.token_id("<|end|>")]
    rm, batch = _hacked_rm(tok, model_cfg, examples, prompts, degenerate)
    bad, bad_last, good, good_last = batch
    with torch.no_grad():
        before = head_scores(rm, bad, bad_last).mean(-1) - head_scores(rm, good, good_last).mean(-1)
    assert (before > 0).all()  # the planted hack: every degenerate output outscores the answer

    cfg = GRPOConfig(reward_model="rm", rm_refresh_every=2, rm_refresh_steps=30, rm_refresh_lr=3e-3)
    shaped = ShapedReward(cfg, tok, "grpo.reward_model", model=rm, out=tmp_path)
    shaped.start(resumed=False)
    fresh = [list(degenerate) for _ in examples]  # the policy's fresh samples: the hack, every time
    initial = {k: v.clone() for k, v in rm.state_dict().items()}
    shaped(examples, prompts, fresh)
    assert shaped.end(0) is None  # every 2 batches: not yet
    hacked_reward = shaped(examples, prompts, fresh)
    record = shaped.end(1)
    assert record["pairs"] == 6 and record["accuracy_before"] == 0.0 and record["accuracy_after"] == 1.0
    assert record["loss_after"] < record["loss_before"]
    with torch.no_grad():
        after = head_scores(rm, bad, bad_last).mean(-1) - head_scores(rm, good, good_last).mean(-1)
    assert (after < 0).all()
    assert (shaped(examples, prompts, fresh) < hacked_reward).all()

    # A resumed run restores the refreshed weights for the batches after the refresh, not before it.
    refreshed = {k: v.clone() for k, v in rm.state_dict().items()}
    for index, want in ((2, refreshed), (1, initial)):
        rm.load_state_dict(initial)
        again = ShapedReward(cfg, tok, "grpo.reward_model", model=rm, out=tmp_path)
        again.start(resumed=True)
        again.begin(index)
        assert all(torch.equal(v, want[k]) for k, v in rm.state_dict().items())
    assert (tmp_path / REFRESH_DIR / "batch_00000001.safetensors").is_file()


# ---- the multi-head reward model -------------------------------------------------------------------


def test_multi_head_loss_weighs_each_heads_pairs_by_its_bootstrap_counts(tok, model_cfg):
    torch.manual_seed(1)
    model = build_model(model_cfg())
    attach_scalar_head(model, 3)
    torch.nn.init.normal_(model.output.weight, std=0.5)
    rows, _ = rm_rows(tok, task_preference_pairs(generate_tasks("reverse", 8, seed=2)), seq_len=48)
    weighted = bootstrap_weights(rows, 3, seed=0)
    assert torch.equal(
        torch.stack([r[4] for r in weighted]), torch.stack([r[4] for r in bootstrap_weights(rows, 3, 0)])
    )
    counts = torch.stack([r[4] for r in weighted])
    assert not torch.equal(counts[:, 0], counts[:, 1])  # the heads see different resamples
    batch = tuple(torch.stack(p) for p in zip(*weighted))
    loss = pair_loss(model, batch)
    rc = torch.stack([model(r[0][None, : r[1] + 1])[0, -1] for r in rows])
    rr = torch.stack([model(r[2][None, : r[3] + 1])[0, -1] for r in rows])
    expected = -(F.logsigmoid(rc - rr) * counts).sum() / counts.sum()
    assert torch.allclose(loss, expected, atol=1e-5)
    assert not torch.allclose(loss, pair_loss(model, batch[:4]), atol=1e-4)  # unweighted differs


def _recipe(tmp_path, grpo: GRPOConfig) -> Recipe:
    recipe = Recipe()
    recipe.train = dataclasses.replace(recipe.train, precision="fp32", peak_flops=1e12, log_every=1, compile=False)
    recipe.tasks = TaskConfig(families=["sort"], train_per_family=40, heldout_per_family=4)
    recipe.rm = RMConfig(
        heads=3, train=StageTrainConfig(lr=1e-3, max_steps=2, warmup_steps=0, seq_len=48, micro_batch_size=4)
    )
    recipe.grpo = grpo
    return recipe


CONTROLS = dict(length_penalty=0.1, rm_refresh_every=1, rm_refresh_steps=1)  # a refresh every batch


def test_rm_heads_then_grpo_and_ppo_with_every_control(tok, model_cfg, tmp_path):
    torch.manual_seed(0)
    cfg = model_cfg(init_std=0.3)
    save_weights(tmp_path / "init", cfg, build_model(cfg).state_dict())
    train = StageTrainConfig(
        lr=1e-2, max_steps=2, warmup_steps=0, seq_len=48, micro_batch_size=4, eval_every=2, eval_batches=1, ckpt_every=2
    )
    grpo = GRPOConfig(
        group_size=2,
        prompts_per_step=2,
        max_new_tokens=4,
        reward_model=str(tmp_path / "rm"),
        reward_ensemble="mean_minus_std",
        uncertainty_penalty=0.5,
        length_target=1,
        train=train,
        **CONTROLS,
    )
    recipe = _recipe(tmp_path, grpo)
    rm_stats = run_stage("rm", recipe, tmp_path / "rm", tmp_path / "init", tok)
    assert len(rm_stats["after"]["heldout"]["head_accuracy"]) == 3
    assert read_manifest(tmp_path / "rm" / "reward_model")["head"]["outputs"] == 3
    assert load_scalar_model(tmp_path / "rm").output.weight.shape == (3, 32)

    stats = run(GRPO(recipe, tmp_path / "grpo", tmp_path / "init", tok), "none")
    records = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    grpo_records = [r for r in records if r["kind"] == "grpo"]
    refreshes = [r for r in records if r["kind"] == "rm_refresh"]
    assert len(grpo_records) == 2 and len(refreshes) == 2 == len(stats["rm_refreshes"])
    for r in grpo_records:
        assert r["rm_std"] > 0 and r["rm_std_max"] >= r["rm_std"]
        # mean of 0.1 * max(0, L - 1) lies between 0.1 * (mean L - 1) and 0.1 * mean L
        assert 0.1 * (r["length_tokens"] - 1) - 1e-6 <= r["length_penalty"] <= 0.1 * r["length_tokens"] + 1e-6
    assert sorted(p.name for p in (tmp_path / "grpo" / REFRESH_DIR).iterdir()) == [
        "batch_00000000.safetensors",
        "batch_00000001.safetensors",
    ]

    # PPO reads the same reward model: min over the heads, the length penalty, a refresh per cycle.
    recipe.ppo = PPOConfig(
        reward=str(tmp_path / "rm"),
        reward_ensemble="min",
        max_new_tokens=4,
        ppo_epochs=1,
        minibatches=1,
        train=dataclasses.replace(train, eval_every=1, ckpt_every=1),
        **CONTROLS,
    )
    stats = run_stage("ppo", recipe, tmp_path / "ppo", tmp_path / "init", tok)
    assert len(stats["rollouts"]) == 2 and len(stats["rm_refreshes"]) == 2
    for r in stats["rollouts"]:
        assert r["rm_std"] > 0 and r["length_penalty"] >= 0 and r["rm_refresh"]["batch"] == r["cycle"]
    records = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in records if r["kind"] == "rm_refresh"] == [0, 1]


# ---- refusals --------------------------------------------------------------------------------------


def test_rm_heads_and_one_head_ensembles_are_refused(tok, tmp_path, model_cfg):
    with pytest.raises(ConfigError) as err:
        RMConfig(heads=0).validate()
    assert err.value.key == "heads"
    rm = build_model(model_cfg())
    attach_scalar_head(rm)
    with pytest.raises(ConfigError, match="multi-head") as err:
        ShapedReward(PPOConfig(reward="rm", reward_ensemble="min"), tok, "ppo.reward", model=rm)
    assert err.value.key == "ppo.reward_ensemble"
    # A custom reward function is not a reward model: nothing to refresh.
    recipe = Recipe()
    recipe.tasks = TaskConfig(families=["sort"], train_per_family=10, heldout_per_family=4)
    recipe.ppo = PPOConfig(reward="rm", rm_refresh_every=1)
    stage = PPO(recipe, tmp_path / "ppo", tmp_path / "init", tok, reward_fn=lambda e, p, c: [0.0] * len(c))
    with pytest.raises(ConfigError) as err:
        stage.sources()
    assert err.value.key == "ppo.rm_refresh_every"
