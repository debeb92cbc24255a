import pytest

from kiln.infer.kv_cache import KVCache


def test_split_moves_rows_into_a_new_cache_and_keeps_the_others():
    cache = KVCache(n_layers=2, batch=3, n_kv_heads=1, max_len=5, head_dim=2)
    for row in range(3):
        cache.k[:, row], cache.v[:, row] = row + 1, -(row + 1)
    cache.set_lengths([4, 2, 3])
    moved = cache.split([2, 0])
    assert moved.max_len == 5 and moved.lengths == [3, 4] and cache.lengths == [2]
    assert moved.k[:, 0].eq(3).all() and moved.k[:, 1].eq(1).all() and moved.v[:, 1].eq(-1).all()
    assert cache.k.shape[1] == 1 and cache.k.eq(2).all() and cache.v.eq(-2).all()
    moved.k[:, 0] = 0  # a copy: the rows left behind do not share storage with it
    assert cache.k.eq(2).all()


def test_split_only_between_steps():
    cache = KVCache(n_layers=1, batch=2, n_kv_heads=1, max_len=4, head_dim=2)
    cache.prepare(1)
    with pytest.raises(RuntimeError, match="between steps"):
        cache.split([0])
