"""Batch sources of the post-training stages: fixed examples (deterministic, rank-sliced, resumable)
and online batches made from the trainer the source is bound to."""

import pytest
import torch

from kiln.post.sources import ExampleSource, OnlineSource


def _rows(n):
    return [(torch.tensor([i, i]), torch.tensor([i])) for i in range(n)]


def test_example_source_is_deterministic_rank_sliced_and_resumable():
    a, b = ExampleSource(_rows(10), 2, seed=3), ExampleSource(_rows(10), 2, seed=3)
    it_a, it_b = iter(a), iter(b)
    seq_a = [next(it_a)[1].flatten().tolist() for _ in range(12)]
    seq_b = [next(it_b)[1].flatten().tolist() for _ in range(12)]
    assert seq_a == seq_b
    # Two ranks of batch 1 read exactly the single-rank batch of 2, split.
    single = iter(ExampleSource(_rows(10), 2, seed=5))
    ranks = [iter(ExampleSource(_rows(10), 1, rank=r, world_size=2, seed=5)) for r in (0, 1)]
    for _ in range(7):
        whole = next(single)[1].flatten().tolist()
        assert whole == [next(ranks[0])[1].item(), next(ranks[1])[1].item()]
    # Resume continues the same stream.
    src = ExampleSource(_rows(10), 2, seed=1)
    it = iter(src)
    for _ in range(7):
        next(it)
    state = src.state_dict()
    expected = [next(it)[1].flatten().tolist() for _ in range(5)]
    again = ExampleSource(_rows(10), 2, seed=1)
    again.load_state_dict(state)
    it2 = iter(again)
    assert [next(it2)[1].flatten().tolist() for _ in range(5)] == expected
    with pytest.raises(ValueError, match="examples"):
        ExampleSource(_rows(12), 2, seed=1).load_state_dict(state)


def test_online_source_makes_each_batch_from_its_trainer_index_and_seed():
    calls = []
    source = OnlineSource(
        lambda trainer, index, seed: calls.append((trainer, index, seed)) or (torch.tensor([index]),), seed=2
    )
    with pytest.raises(RuntimeError, match="bind"):
        next(iter(source))
    source.bind("the trainer")
    it = iter(source)
    assert [next(it)[0].item() for _ in range(3)] == [0, 1, 2]
    assert calls == [("the trainer", i, 2 * 1_000_003 + i) for i in range(3)]
    again = OnlineSource(lambda trainer, index, seed: (torch.tensor([index]),), seed=2)
    again.load_state_dict(source.state_dict())
    again.bind("another trainer")
    assert next(iter(again))[0].item() == 3  # the batch counter is the whole state


class _Trainer:
    accum_steps = 2  # micro-batches per optimizer step


def test_online_source_serves_each_steps_batches_to_steps_per_batch_steps():
    calls = []

    def make(trainer, index, seed):
        calls.append((index, seed))
        return (torch.tensor([index]),)

    source = OnlineSource(make, seed=2, steps_per_batch=3)
    source.bind(_Trainer())
    it = iter(source)
    served = [next(it)[0].item() for _ in range(2 * 2 * 3)]  # two groups of three steps of two micro-batches
    assert served == [0, 1] * 3 + [2, 3] * 3
    # make_batch is asked once per distinct batch, with the index and seed of steps_per_batch = 1.
    assert calls == [(i, 2 * 1_000_003 + i) for i in range(4)]
    # Resumed at a group boundary (step 6), it asks for the batches an uninterrupted run would.
    again = OnlineSource(make, seed=2, steps_per_batch=3)
    again.load_state_dict({"batches": 12, "seed": 2})
    again.bind(_Trainer())
    resumed = iter(again)
    assert [next(resumed)[0].item() for _ in range(6)] == [4, 5] * 3
    # Inside a group, the policy that sampled the group's batches is gone: refused.
    inside = OnlineSource(make, seed=2, steps_per_batch=3)
    inside.load_state_dict({"batches": 2, "seed": 2})
    inside.bind(_Trainer())
    with pytest.raises(RuntimeError, match="multiple of 3 steps"):
        next(iter(inside))


def test_validation_covers_every_example_by_default_and_spreads_a_budget():
    source = ExampleSource(_rows(10), 3, shuffle=False)
    whole = [row.item() for _, y in source.validation_batches() for row in y]
    assert whole == list(range(10))  # three batches of 3 and the last example
    sample = [row.item() for _, y in source.validation_batches(1) for row in y]
    assert sample[0] < 3 <= sample[1] < 6 <= sample[2]  # one of each third of the examples
    assert sample == [row.item() for _, y in source.validation_batches(1) for row in y]
    online = OnlineSource(lambda trainer, index, seed: None, val_batches=[(torch.tensor([i]),) for i in range(8)])
    assert [b[0].item() for b in online.validation_batches()] == list(range(8))
    picked = [b[0].item() for b in online.validation_batches(2)]
    assert len(picked) == 2 and picked[0] < 4 <= picked[1]  # one from each half
    with pytest.raises(ValueError, match="regrouped"):
        next(online.validation_batches(0, row_multiple=2))
