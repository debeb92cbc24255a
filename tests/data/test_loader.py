import json

import numpy as np
import pytest
import torch

from kiln.data.loader import TokenLoader, spread_sample
from kiln.data.pack import write_shard
from kiln.errors import ConfigError, DataError

SHA = "ab" * 32
T = 8


def header(source, dtype="uint16", vocab=2000, sha=SHA, nbytes=None, documents=1):
    return {
        "dtype": dtype,
        "vocab_size": vocab,
        "tokenizer_sha256": sha,
        "documents": documents,
        "bytes": nbytes or 0,
        "source": source,
    }


def make_pack(root, train=None, val=None, weights=None, dtype="uint16", vocab=2000):
    """Shards whose token values say where they came from: source a holds 0..999 over two shards,
    source b holds 1000..1299, so a window's first token identifies its source and position."""
    train = train or {"a": [np.arange(0, 500), np.arange(500, 1000)], "b": [np.arange(1000, 1300)]}
    val = val or {"a": [np.arange(0, 100)], "b": [np.arange(1000, 1050)]}
    for split, sources in (("train", train), ("val", val)):
        (root / split).mkdir(parents=True, exist_ok=True)
        for name, shards in sources.items():
            for k, tokens in enumerate(shards):
                write_shard(
                    root / split / f"{name}-{k:05d}.bin", tokens, header(name, dtype, vocab, nbytes=3 * len(tokens))
                )
    if weights is not None:
        (root / "mixture.json").write_text(
            json.dumps({"vocab_size": vocab, "tokenizer_sha256": SHA, "weights": weights})
        )
    return root


def take(loader, n):
    return [next(loader) for _ in range(n)]


def test_one_epoch_visits_every_window_once_and_windows_share_one_token(tmp_path):
    pack = make_pack(tmp_path)
    loader = TokenLoader(pack, seq_len=T, batch_size=4, mixture={"a": 1.0})
    per_shard = (500 - 1) // T
    batches = take(loader, 2 * per_shard // 4 + 1)  # 124 windows = one epoch, then one more batch
    starts = [int(x[i, 0]) for x, _ in batches for i in range(4)]
    expected = sorted([i * T for i in range(per_shard)] + [500 + i * T for i in range(per_shard)])
    assert sorted(starts[: 2 * per_shard]) == expected
    assert starts[: 2 * per_shard] != expected  # shuffled, not sequential
    assert sorted(starts[2 * per_shard :]) != sorted(starts[:4])  # epoch 2 has its own order
    for x, y in batches:
        assert x.dtype == torch.int64 and x.shape == (4, T)
        assert torch.equal(y, x + 1)  # y is x shifted by one; tokens are consecutive integers
        # window i = tokens[i*T : i*T+T+1]: its last token is the first of window i+1, none skipped
        assert all(int(y[i, -1]) == int(x[i, 0]) + T for i in range(4))


def test_same_seed_same_batches_other_seed_differs(tmp_path):
    pack = make_pack(tmp_path, weights={"a": 0.5, "b": 0.5})
    a = take(TokenLoader(pack, seq_len=T, batch_size=4, seed=3), 20)
    b = take(TokenLoader(pack, seq_len=T, batch_size=4, seed=3), 20)
    c = take(TokenLoader(pack, seq_len=T, batch_size=4, seed=4), 20)
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, b))
    assert not all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(a, c))


@pytest.mark.parametrize("stop_after", [3, 40])  # mid-epoch, and after several per-source epochs
def test_resume_is_bit_identical_to_uninterrupted(tmp_path, stop_after):
    pack = make_pack(tmp_path, weights={"a": 0.7, "b": 0.3})
    uninterrupted = take(TokenLoader(pack, seq_len=T, batch_size=4, seed=1), stop_after + 30)
    first = TokenLoader(pack, seq_len=T, batch_size=4, seed=1)
    take(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint manifest
    resumed = TokenLoader(pack, seq_len=T, batch_size=4, seed=1)
    resumed.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(uninterrupted[stop_after:], take(resumed, 30)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_rank_slices_are_disjoint_and_form_the_global_batch(tmp_path):
    pack = make_pack(tmp_path, weights={"a": 0.6, "b": 0.4})
    single = take(TokenLoader(pack, seq_len=T, batch_size=6, world_size=1, seed=2), 10)
    ranks = [take(TokenLoader(pack, seq_len=T, batch_size=2, rank=r, world_size=3, seed=2), 10) for r in range(3)]
    for step, (x, y) in enumerate(single):
        assert torch.equal(torch.cat([ranks[r][step][0] for r in range(3)]), x)
        assert torch.equal(torch.cat([ranks[r][step][1] for r in range(3)]), y)
        starts = [int(ranks[r][step][0][i, 0]) for r in range(3) for i in range(2)]
        assert len(set(starts)) == 6  # within one epoch no window is handed to two ranks


def test_state_resumes_on_a_different_world_size(tmp_path):
    pack = make_pack(tmp_path, weights={"a": 0.5, "b": 0.5})
    single = TokenLoader(pack, seq_len=T, batch_size=4, seed=5)
    take(single, 7)
    state = single.state_dict()
    expected = take(single, 5)
    halves = []
    for r in range(2):
        loader = TokenLoader(pack, seq_len=T, batch_size=2, rank=r, world_size=2, seed=5)
        loader.load_state_dict(state)
        halves.append(take(loader, 5))
    for step, (x, _) in enumerate(expected):
        assert torch.equal(torch.cat([halves[0][step][0], halves[1][step][0]]), x)


def test_mixture_proportions_are_honoured(tmp_path):
    pack = make_pack(tmp_path, weights={"a": 0.5, "b": 0.5})
    loader = TokenLoader(pack, seq_len=T, batch_size=50, seed=0, mixture={"a": 0.8, "b": 0.2})
    assert loader.weights == {"a": 0.8, "b": 0.2}
    firsts = torch.cat([x[:, 0] for x, _ in take(loader, 80)])
    share_a = (firsts < 1000).float().mean().item()
    assert abs(share_a - 0.8) < 0.03  # 4000 draws: standard error 0.006


def test_default_weights_come_from_mixture_json(tmp_path):
    pack = make_pack(tmp_path, weights={"a": 0.0, "b": 2.0})
    loader = TokenLoader(pack, seq_len=T, batch_size=8)
    assert loader.weights == {"b": 1.0}
    assert all(bool((x >= 1000).all()) for x, _ in take(loader, 10))


def test_val_is_sequential_interleaved_and_repeatable(tmp_path):
    pack = make_pack(tmp_path, weights={"a": 1, "b": 1})
    val = TokenLoader(pack, split="val", seq_len=T, batch_size=3)
    a_windows, b_windows = (100 - 1) // T, (50 - 1) // T
    assert val.num_batches == (a_windows + b_windows) // 3
    first = list(val.iter_batches(2))
    again = list(val.iter_batches(2))
    assert len(first) == 2 and all(torch.equal(p[0], q[0]) for p, q in zip(first, again))
    everything = list(val)
    assert len(everything) == val.num_batches and next(iter(val), None) is None  # finite
    assert all(torch.equal(p[0], q[0]) for p, q in zip(first, everything))
    starts = [int(x[i, 0]) for x, _ in everything for i in range(3)]
    a_starts = [s for s in starts if s < 1000]
    assert a_starts == sorted(a_starts)  # no shuffling within a source
    assert any(s >= 1000 for s in starts[:6])  # both sources appear early, not one after the other
    val.reset()
    assert torch.equal(next(val)[0], first[0][0])
    assert len(list(val.iter_batches(10_000))) == val.num_batches


def _window_starts(batches) -> list[int]:
    """The first token of every window of these batches (make_pack's tokens say where they are)."""
    return [int(x[i, 0]) for x, _ in batches for i in range(x.shape[0])]


def test_validation_batches_cover_every_window_once_with_the_tail(tmp_path):
    pack = make_pack(tmp_path)  # 12 windows of a, 6 of b: 4 batches of 4 and a tail of 2
    every = sorted(list(range(0, 12 * T, T)) + list(range(1000, 1000 + 6 * T, T)))
    val = TokenLoader(pack, split="val", seq_len=T, batch_size=4)
    batches = list(val.validation_batches())
    assert [x.shape[0] for x, _ in batches] == [4, 4, 4, 4, 2]
    assert sorted(_window_starts(batches)) == every
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in batches)
    # Two ranks: the same number of batches each (sharded models run collectives in every forward),
    # together every window once, the tail split evenly.
    ranks = [
        list(TokenLoader(pack, split="val", seq_len=T, batch_size=2, rank=r, world_size=2).validation_batches())
        for r in (0, 1)
    ]
    assert [[x.shape[0] for x, _ in r] for r in ranks] == [[2, 2, 2, 2, 1]] * 2
    assert sorted(_window_starts(ranks[0]) + _window_starts(ranks[1])) == every
    # Four ranks cannot share a tail of 2 evenly: it is left out, and the rest is covered once.
    four = [TokenLoader(pack, split="val", seq_len=T, batch_size=1, rank=r, world_size=4) for r in range(4)]
    starts = [s for loader in four for s in _window_starts(loader.validation_batches())]
    assert len(starts) == 16 and len(set(starts)) == 16
    # A pipeline's tail must split into its microbatches: with 4 of them a tail of 2 is left out.
    assert len(_window_starts(val.validation_batches(row_multiple=4))) == 16


def test_validation_sample_is_spread_over_the_split_and_fixed(tmp_path):
    pack = make_pack(tmp_path, val={"a": [np.arange(0, 100 * T + 1)]})  # 100 windows, window i starts at i*T
    val = TokenLoader(pack, split="val", seq_len=T, batch_size=4, seed=1)
    chosen = [s // T for s in _window_starts(val.validation_batches(3))]
    assert len(chosen) == 12 and len(set(chosen)) == 12  # 3 global batches of 4, no window twice
    assert {c * 4 // 100 for c in chosen} == {0, 1, 2, 3}  # every quarter of the split, the last included
    assert chosen != list(range(12))  # not the first windows
    # The same windows at every evaluation, in a fresh loader (a resumed run) and whatever the seed.
    assert [s // T for s in _window_starts(val.validation_batches(3))] == chosen
    fresh = TokenLoader(pack, split="val", seq_len=T, batch_size=4, seed=7)
    assert [s // T for s in _window_starts(fresh.validation_batches(3))] == chosen
    # A budget of at least the split is the whole split.
    assert len(_window_starts(val.validation_batches(25))) == 100


def test_spread_sample_draws_one_index_per_stratum():
    picks = spread_sample(1000, 10)
    assert len(picks) == 10 and list(picks // 100) == list(range(10))
    assert list(spread_sample(1000, 10)) == list(picks)
    assert len(set(spread_sample(1000, 10, seed=1)) ^ set(picks)) > 0  # the draw is random within strata
    assert list(spread_sample(5, 0)) == list(range(5)) and list(spread_sample(5, 9)) == list(range(5))


def test_val_rank_slices_partition_the_global_batch(tmp_path):
    pack = make_pack(tmp_path)
    single = list(TokenLoader(pack, split="val", seq_len=T, batch_size=4).iter_batches(3))
    parts = [
        list(TokenLoader(pack, split="val", seq_len=T, batch_size=2, rank=r, world_size=2).iter_batches(3))
        for r in range(2)
    ]
    for step, (x, _) in enumerate(single):
        assert torch.equal(torch.cat([parts[0][step][0], parts[1][step][0]]), x)


def test_val_state_dict_round_trip(tmp_path):
    pack = make_pack(tmp_path)
    val = TokenLoader(pack, split="val", seq_len=T, batch_size=2)
    next(val)
    state = val.state_dict()
    expected = next(val)[0]
    other = TokenLoader(pack, split="val", seq_len=T, batch_size=2)
    other.load_state_dict(state)
    assert torch.equal(next(other)[0], expected)


def test_uint32_shards_and_header_metadata(tmp_path):
    big = {"a": [np.arange(70_000, 70_400)]}
    pack = make_pack(tmp_path, train=big, val=big, dtype="uint32", vocab=100_000)
    loader = TokenLoader(pack, seq_len=T, batch_size=2)
    x, y = next(loader)
    assert int(x.min()) >= 70_000 and torch.equal(y, x + 1)
    assert loader.vocab_size == 100_000
    assert loader.bytes_per_token == pytest.approx(3.0)
    assert (tmp_path / "train" / "a-00000.bin").stat().st_size == 400 * 4


def test_missing_or_empty_pack_dir_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no token shards"):
        TokenLoader(tmp_path / "nope")
    (tmp_path / "empty" / "train").mkdir(parents=True)
    with pytest.raises(DataError, match="empty"):
        TokenLoader(tmp_path / "empty")


def test_headers_from_different_tokenizers_are_rejected_naming_the_file(tmp_path):
    pack = make_pack(tmp_path)
    path = pack / "train" / "b-00000.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_sha256": "cd" * 32}))
    with pytest.raises(DataError, match="b-00000.json: tokenizer_sha256"):
        TokenLoader(pack)


def test_dtype_disagreement_and_truncated_bin_are_rejected(tmp_path):
    pack = make_pack(tmp_path)
    bin_path = pack / "train" / "b-00000.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(DataError, match="b-00000.bin: 598 bytes"):
        TokenLoader(pack)
    path = pack / "train" / "a-00001.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "dtype": "uint32"}))
    with pytest.raises(DataError, match="a-00001.json: dtype"):
        TokenLoader(pack)


def test_bad_arguments(tmp_path):
    pack = make_pack(tmp_path)
    with pytest.raises(ConfigError, match="mixture.c"):
        TokenLoader(pack, mixture={"a": 1.0, "c": 1.0})
    with pytest.raises(ConfigError, match="rank"):
        TokenLoader(pack, rank=2, world_size=2)
    with pytest.raises(DataError, match="fewer than seq_len"):
        TokenLoader(pack, seq_len=400, mixture={"b": 1.0})
    loader = TokenLoader(pack, seq_len=T, seed=0)
    with pytest.raises(DataError, match="seed"):
        TokenLoader(pack, seq_len=T, seed=1).load_state_dict(loader.state_dict())
