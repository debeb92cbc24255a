"""`ppo.missing_stop_penalty` lowers the reward of a completion that never stopped by exactly the
penalty, and leaves a completion that stopped alone (TRL's `missing_eos_penalty`)."""

import torch
from kiln_testing.models import ForcesToken

from kiln.data.chat import render_prompt
from kiln.model import build_model
from kiln.post.config import PPOConfig
from kiln.post.ppo import make_rollout
from kiln.post.rm import attach_scalar_head
from kiln.post.tasks import generate_tasks

SEQ = 64
PENALTY = 0.75


def _rollout(tok, actor, critic, reference, prompts, examples, penalty: float):
    # kl_coef 0: the whole reward is the score, on the completion's last token.
    cfg = PPOConfig(max_new_tokens=6, kl_coef=0.0, missing_stop_penalty=penalty)
    reward = lambda examples, prompts, completions: [1.0] * len(completions)  # noqa: E731
    return make_rollout(actor, critic, reference, tok, examples, prompts, reward, cfg, SEQ, seed=3)


def test_missing_stop_penalty_lowers_only_the_unstopped_reward(tok, model_cfg):
    examples = generate_tasks("arithmetic", 20, seed=1)
    rendered = [render_prompt(tok, [{"role": "user", "content": e["prompt"]}]) for e in examples]
    by_length = sorted(range(len(rendered)), key=lambda i: len(rendered[i]))
    short, long = by_length[0], by_length[-1]
    assert len(rendered[long]) > len(rendered[short]) + 1  # position len(short) + 1 is in the long prompt
    prompts, examples = [rendered[short], rendered[long]], [examples[short], examples[long]]

    torch.manual_seed(0)
    cfg = model_cfg(init_std=0.3)
    reference = build_model(cfg)
    critic = build_model(cfg)
    critic.load_state_dict(reference.state_dict())
    attach_scalar_head(critic)
    # The stop token is forced as the second completion token of the short prompt; for the long
    # prompt that position lies inside its prompt, so it runs to max_new_tokens without stopping.
    end = tok.token_id("<|end|>")
    actor = ForcesToken(reference, end, at=len(prompts[0]) + 1, onward=False)

    plain = _rollout(tok, actor, critic, reference, prompts, examples, penalty=0.0)
    penalised = _rollout(tok, actor, critic, reference, prompts, examples, penalty=PENALTY)
    mask = plain.mask
    assert torch.equal(plain.targets, penalised.targets)  # the same completions: same seed
    last = mask.cumsum(1).argmax(1)
    final = plain.targets[torch.arange(2), last]
    assert final[0] == end and final[1] not in (end, tok.eot_id)
    assert mask[1].sum() == 6 and mask[0].sum() == 2

    assert plain.scores.tolist() == [1.0, 1.0]
    assert penalised.scores.tolist() == [1.0, 1.0 - PENALTY]
    expected = torch.zeros_like(plain.rewards)
    expected[1, last[1]] = PENALTY
    assert torch.equal(plain.rewards - penalised.rewards, expected)
    assert penalised.stats["stopped"] == 0.5
