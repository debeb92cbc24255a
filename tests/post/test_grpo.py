"""`kiln grpo`: the prompt pool, the stage's objective against DeepSeekMath's GRPO on worked
numbers (clipped ratio to the sampling policy, k3 KL to a frozen reference), the reference loaded
only when beta > 0, `epochs` optimizer steps per rollout batch with `clip_eps` acting on them,
exact resume across rollout batches, and the config errors."""

import dataclasses
import json
import math
import shutil

import pytest
import torch

from kiln.checkpoint import complete_checkpoints, save_weights
from kiln.errors import ConfigError
from kiln.model import build_model
from kiln.model.weights import load_weights
from kiln.post.config import GRPOConfig, StageTrainConfig, TaskConfig
from kiln.post.driver import run
from kiln.post.grpo import GRPO, make_grpo_loss, rl_prompts
from kiln.post.losses import token_logprobs
from kiln.post.protocol import Stage
from kiln.post.tasks import heldout_tasks, train_tasks
from kiln.recipe import Recipe, load_recipe


def test_grpo_prompt_seed_draws_train_problems_sft_did_not_see():
    base = load_recipe("recipes/tiny.toml", ["grpo.prompt_seed=0", "tasks.train_per_family=300"])
    fresh = load_recipe("recipes/tiny.toml", ["grpo.prompt_seed=1", "tasks.train_per_family=300"])
    sft_problems = train_tasks(base.tasks)
    assert rl_prompts(base) == sft_problems  # prompt_seed = tasks.seed: the SFT problems
    pool = rl_prompts(fresh)
    assert len(pool) == len(sft_problems)
    seen = {ex["id"] for ex in sft_problems}
    assert sum(ex["id"] in seen for ex in pool) < len(pool) // 2
    heldout = {ex["id"] for ex in heldout_tasks(fresh.tasks)}
    assert not heldout & {ex["id"] for ex in pool}


# ---- the objective on worked numbers ---------------------------------------------------------------


class FixedLogits(torch.nn.Module):
    """A 'policy' whose logits are a parameter, so the loss and its gradient can be read exactly."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.logits = torch.nn.Parameter(torch.randn(2, 3, 5, generator=g, dtype=torch.float64))

    def forward(self, inputs):
        return self.logits


def worked_batch(model, with_ref: bool):
    """Two sequences of one group: A = +1 with two completion tokens, A = -1 with one (then padding).
    The old and reference log-probs are set against the policy's own: log ratios 0.1, 0.3 | -0.4 and
    ref - logp = 0.2, -0.1 | 0.5."""
    targets = torch.tensor([[1, 2, -100], [3, -100, -100]])
    logp = token_logprobs(model.logits, targets).detach()
    log_ratio = torch.tensor([[0.1, 0.3, 0.0], [-0.4, 0.0, 0.0]], dtype=torch.float64)
    ref_minus_logp = torch.tensor([[0.2, -0.1, 0.0], [0.5, 0.0, 0.0]], dtype=torch.float64)
    batch = (torch.zeros(2, 3, dtype=torch.long), targets, torch.tensor([1.0, -1.0]), logp - log_ratio)
    return batch + ((logp + ref_minus_logp,) if with_ref else ())


def test_stage_loss_is_deepseekmath_grpo_with_k3_kl_on_worked_numbers():
    """DeepSeekMath (Shao et al. 2024) eq. 3 with the KL of eq. 4:
    J = 1/G sum_i 1/|o_i| sum_t [min(r A_i, clip(r, 1-eps, 1+eps) A_i) - beta (pi_ref/pi - log(pi_ref/pi) - 1)],
    the loss is -J; eps 0.2, beta 0.1."""
    k3 = [math.exp(d) - d - 1 for d in (0.2, -0.1, 0.5)]  # 0.0214028, 0.0048374, 0.1487213
    # Sequence 1, A = +1: r = e^0.1 = 1.105171 is inside the clip; r = e^0.3 = 1.349859 is clipped to 1.2.
    seq1 = (math.exp(0.1) - 0.1 * k3[0] + 1.2 - 0.1 * k3[1]) / 2
    # Sequence 2, A = -1: r = e^-0.4 = 0.670320 and min(-0.670320, -0.8) = -0.8.
    seq2 = -0.8 - 0.1 * k3[2]
    expected = -(seq1 + seq2) / 2
    assert expected == pytest.approx(-0.1682006616, abs=1e-9)

    model = FixedLogits()
    cfg = GRPOConfig(epochs=2, clip_eps=0.2, beta=0.1)
    loss, rows = make_grpo_loss(cfg)(model, worked_batch(model, with_ref=True))
    assert rows == 2 and loss.item() == pytest.approx(expected, abs=1e-9)

    # beta = 0: no KL term, and the batch carries no reference log-probs.
    plain, _ = make_grpo_loss(GRPOConfig(epochs=2))(model, worked_batch(model, with_ref=False))
    assert plain.item() == pytest.approx(-((math.exp(0.1) + 1.2) / 2 - 0.8) / 2, abs=1e-9)  # -0.1762927

    # beta changes the gradient too: k3's derivative in logp is 1 - pi_ref/pi = 1 - e^(ref - logp),
    # weighted by beta / |o_i| / G. Only the tokens the clip leaves active carry the policy term.
    def grad(cfg, with_ref):
        model.zero_grad()
        make_grpo_loss(cfg)(model, worked_batch(model, with_ref))[0].backward()
        return model.logits.grad.clone()

    with_kl, without = grad(cfg, True), grad(GRPOConfig(epochs=2), False)
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    kl_part = (
        0.1 * ((1 - math.exp(0.2)) * logp[0, 0] / 2 + (1 - math.exp(-0.1)) * logp[0, 1] / 2) / 2
        + 0.1 * (1 - math.exp(0.5)) * logp[1, 0] / 2
    )
    (dlogp,) = torch.autograd.grad(kl_part, logp)
    # Back to the logits through log_softmax: d logp_t / d logits_t = onehot - softmax.
    targets = worked_batch(model, True)[1]
    onehot = torch.nn.functional.one_hot(targets.clamp(min=0), 5).double() * (targets != -100)[..., None]
    soft = model.logits.detach().softmax(-1) * (targets != -100)[..., None]
    torch.testing.assert_close(with_kl - without, dlogp[..., None] * (onehot - soft))


def test_clip_eps_acts_on_the_ratio_to_the_sampling_policy():
    model = FixedLogits()
    batch = worked_batch(model, with_ref=False)
    wide, _ = make_grpo_loss(GRPOConfig(epochs=2, clip_eps=0.5))(model, batch)
    # eps 0.5: nothing is clipped (1.349859 < 1.5 and 0.670320 > 0.5).
    assert wide.item() == pytest.approx(-((math.exp(0.1) + math.exp(0.3)) / 2 - math.exp(-0.4)) / 2, abs=1e-9)


# ---- the stage -------------------------------------------------------------------------------------


class FirstTokenGRPO(GRPO):
    """Rewards completions whose first token is in the lower half of the vocabulary: learnable by a
    random tiny model, so the advantages are not all zero."""

    def rewards(self, examples, prompts, completions):
        half = self.tokenizer.vocab_size // 2
        return torch.tensor([float(bool(c) and c[0] < half) for c in completions])


def grpo_recipe(**overrides) -> Recipe:
    recipe = Recipe()
    recipe.train = dataclasses.replace(recipe.train, precision="fp32", peak_flops=1e12, log_every=1, compile=False)
    recipe.tasks = TaskConfig(families=["sort"], train_per_family=40, heldout_per_family=4)
    train = StageTrainConfig(
        lr=1e-2, max_steps=4, warmup_steps=0, seq_len=48, micro_batch_size=4, eval_every=2, eval_batches=1, ckpt_every=2
    )
    recipe.grpo = GRPOConfig(group_size=4, prompts_per_step=4, max_new_tokens=4, train=train, **overrides)
    return recipe


@pytest.fixture
def init(model_cfg, tmp_path):
    torch.manual_seed(0)
    cfg = model_cfg(init_std=0.3)
    save_weights(tmp_path / "init", cfg, build_model(cfg).state_dict())
    return tmp_path / "init"


def run_grpo(recipe, out, init, tok, resume="none"):
    stats = run(FirstTokenGRPO(recipe, out, init, tok), resume)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return stats, [r for r in records if r["kind"] == "grpo"]


def test_beta_zero_loads_no_reference(tok, init, tmp_path, monkeypatch):
    def refuse(self):
        raise AssertionError("beta = 0 must not load a reference model")

    monkeypatch.setattr(Stage, "reference_model", refuse)
    stats, records = run_grpo(grpo_recipe(), tmp_path / "grpo", init, tok)
    assert stats["train"]["steps"] == 4
    assert "mean_kl" not in stats["rollout"] and all("kl" not in r for r in records)


def test_beta_holds_a_frozen_reference_and_the_kl_to_it_grows_from_zero(tok, init, tmp_path, monkeypatch):
    loaded = []
    original = Stage.reference_model
    monkeypatch.setattr(Stage, "reference_model", lambda self: loaded.append(original(self)) or loaded[-1])
    stage = FirstTokenGRPO(grpo_recipe(beta=0.1), tmp_path / "grpo", init, tok)
    stats = run(stage, "none")
    (reference,) = loaded
    assert stage.reference is reference and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    state = {k: v for k, v in load_weights(init)[1].items()}
    assert all(torch.equal(v, state[k]) for k, v in reference.state_dict().items())  # still the init weights
    records = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    kls = [r["kl"] for r in records if r["kind"] == "grpo"]
    # Step 1 trains the init weights, the reference itself: the KL is exactly 0; then it grows.
    assert len(kls) == 4 and kls[0] == 0.0 and kls[-1] > 0
    assert stats["rollout"]["mean_kl"] == pytest.approx(sum(kls) / 4)


def test_epochs_reuse_each_rollout_batch_and_clip_eps_changes_the_update(tok, init, tmp_path):
    results = {}
    for clip in (0.1, 0.5):
        stats, records = run_grpo(grpo_recipe(epochs=2, clip_eps=clip), tmp_path / f"clip{clip}", init, tok)
        assert stats["train"]["steps"] == 4
        # Two rollout batches of 4 prompts x 4 completions, each trained on for two optimizer steps.
        assert stats["rollout"]["rollouts"] == 2 * 4 * 4 and len(records) == 2
        results[clip] = stats, records, load_weights(tmp_path / f"clip{clip}")[1]
    narrow, wide = results[0.1], results[0.5]
    # The first step of a batch is on the policy that sampled it (ratio 1, nothing clipped); the
    # second sees the moved policy, where eps 0.1 clips tokens that eps 0.5 keeps.
    assert narrow[1][0]["clip_fraction"] > 0 and narrow[1][0]["ratio"] != 1.0
    assert wide[1][0]["clip_fraction"] < narrow[1][0]["clip_fraction"]
    assert any(not torch.equal(narrow[2][k], wide[2][k]) for k in narrow[2])


def test_resume_between_rollout_batches_is_exact(tok, init, tmp_path):
    recipe = grpo_recipe(epochs=2, clip_eps=0.1, beta=0.05)
    run_grpo(recipe, tmp_path / "grpo", init, tok)
    finished = load_weights(tmp_path / "grpo")[1]
    last = complete_checkpoints(tmp_path / "grpo" / "checkpoints")[-1]
    assert last.name.endswith("4")
    shutil.rmtree(last)  # the run continues from step 2, the start of the second rollout batch
    with pytest.warns(UserWarning, match="init_from"):
        stats, _ = run_grpo(recipe, tmp_path / "grpo", init, tok, resume="auto")
    assert stats["train"]["resumed_from"].endswith("2")
    resumed = load_weights(tmp_path / "grpo")[1]
    assert all(torch.equal(finished[k], resumed[k]) for k in finished)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"epochs": 0}, "grpo.epochs"),
        ({"beta": -0.1}, "grpo.beta"),
        ({"clip_eps": 0.0}, "grpo.clip_eps"),
        ({"clip_eps": 1.0, "epochs": 2}, "grpo.clip_eps"),
        ({"clip_eps": 0.1}, "grpo.clip_eps"),  # epochs = 1: the ratio is 1, a clip would do nothing
        ({"epochs": 2, "train": StageTrainConfig(eval_every=4, ckpt_every=3)}, "grpo.train.ckpt_every"),
        ({"epochs": 2, "train": StageTrainConfig(eval_every=3, ckpt_every=4)}, "grpo.train.eval_every"),
        # the reward controls (tests/post/test_reward_hacking.py)
        ({"reward_ensemble": "median", "reward_model": "x"}, "grpo.reward_ensemble"),
        ({"reward_ensemble": "min"}, "grpo.reward_ensemble"),  # the verifier has no heads
        ({"reward_ensemble": "mean_minus_std", "reward_model": "x"}, "grpo.uncertainty_penalty"),
        ({"uncertainty_penalty": 0.5, "reward_model": "x"}, "grpo.uncertainty_penalty"),
        ({"length_penalty": -1.0}, "grpo.length_penalty"),
        ({"length_target": 8}, "grpo.length_target"),
        ({"rm_refresh_every": 2}, "grpo.rm_refresh_every"),  # no reward model to refresh
        ({"rm_refresh_steps": 2, "reward_model": "x"}, "grpo.rm_refresh_steps"),
        ({"rm_refresh_every": -1, "reward_model": "x"}, "grpo.rm_refresh_every"),
    ],
)
def test_config_errors_name_the_key(tok, tmp_path, change, key):
    recipe = Recipe()
    recipe.grpo = GRPOConfig(**change)
    with pytest.raises(ConfigError) as err:
        run(GRPO(recipe, tmp_path / "grpo", tmp_path / "init", tok))
    assert err.value.key == key
