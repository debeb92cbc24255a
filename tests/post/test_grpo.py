"""GRPO's prompt pool: [tasks] train-split problems, SFT's or fresh ones (`prompt_seed`)."""

from kiln.post.grpo import rl_prompts
from kiln.post.tasks import heldout_tasks, train_tasks
from kiln.recipe import load_recipe


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
