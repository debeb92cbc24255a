import random

import numpy as np
import pytest
from datasketch import MinHash

from kiln.data import minhash as M


def edit(text: str, fraction: float, rng: random.Random) -> str:
    words = text.split()
    for i in rng.sample(range(len(words)), int(fraction * len(words))):
        words[i] = f"edit{rng.randrange(10**9)}"
    return " ".join(words)


def test_tokens_split_words_and_cjk_characters():
    assert M.tokens("Hello, World! café-naïve x2") == ["hello", "world", "café", "naïve", "x2"]
    assert M.tokens("我爱北京 ABC天安门。") == ["我", "爱", "北", "京", "abc", "天", "安", "门"]
    assert M.tokens("  ...  ") == []


def test_vectorised_token_hashes_match_the_token_rule(stdlib_chunks):
    texts = stdlib_chunks(20, words=80) + ["我爱北京天安门，天安门上太阳升。", "", "!!", "One"]
    hashes, offsets = M.token_hashes(texts)
    seen: dict[str, int] = {}
    for i, text in enumerate(texts):
        toks = M.tokens(text)
        assert offsets[i + 1] - offsets[i] == len(toks)
        for tok, h in zip(toks, hashes[offsets[i] : offsets[i + 1]].tolist()):
            assert seen.setdefault(tok, h) == h  # same token, same hash wherever it occurs
    assert len(set(seen.values())) == len(seen)  # and no two tokens collide


def test_shingles_are_the_exact_shingle_sets(stdlib_chunks):
    texts = stdlib_chunks(30, words=120) + ["a b c", "我爱北京天安门", ""]
    for ngram in (1, 3, 5):
        shingles, offsets = M.shingle_hashes(texts, ngram)
        for i, text in enumerate(texts):
            assert len(set(shingles[offsets[i] : offsets[i + 1]].tolist())) == len(M.shingle_set(text, ngram))


@pytest.mark.parametrize("num_perm,seed", [(112, 1), (64, 7)])
def test_signatures_bit_identical_to_datasketch(num_perm, seed, stdlib_chunks):
    texts = stdlib_chunks(40, words=150) + ["short", ""]
    shingles, offsets = M.shingle_hashes(texts)
    h32 = M.shingle_hashes32(shingles)
    sigs = M.signatures(h32, offsets, num_perm, seed)
    for i in range(len(texts)):
        reference = MinHash(num_perm=num_perm, seed=seed, hashfunc=lambda h: h)
        segment = h32[offsets[i] : offsets[i + 1]]
        if segment.size:
            reference.update_batch(segment.tolist())
        np.testing.assert_array_equal(sigs[i], reference.hashvalues)


def test_estimated_jaccard_tracks_exact_jaccard_on_real_text(stdlib_chunks):
    rng = random.Random(0)
    base = stdlib_chunks(120)
    variants = [edit(t, rng.choice([0.02, 0.05, 0.1, 0.2, 0.4]), rng) for t in base]
    sigs = M.minhash_signatures(base + variants)
    errors = []
    for i in range(len(base)):
        exact = M.exact_jaccard(M.shingle_set(base[i]), M.shingle_set(variants[i]))
        errors.append(abs(M.estimated_jaccard(sigs[i], sigs[len(base) + i]) - exact))
    mae = float(np.mean(errors))
    print(f"MinHash(112) vs exact Jaccard on {len(errors)} real pairs: mean absolute error {mae:.4f}")
    # A single estimate has standard deviation <= 0.5/sqrt(112) = 0.047, so the mean |error| is
    # about 0.8 * that at worst (0.038) and much lower at high similarity.
    assert mae < 0.04
    assert max(errors) < 0.25


def planted_pair(similarity: float, size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Two sets of distinct 32-bit hashes with Jaccard exactly shared / (shared + 2 * unique)."""
    unique = round(size * (1 - similarity) / (1 + similarity))
    shared = size - unique
    values = rng.choice(2**32, shared + 2 * unique, replace=False).astype(np.uint32)
    a = values[: shared + unique]
    b = np.concatenate((values[:shared], values[shared + unique :]))
    return a, b


@pytest.mark.parametrize("similarity", [0.3, 0.5, 0.7, 0.8, 0.9])
def test_lsh_finds_planted_pairs_at_the_s_curve_rate(similarity):
    rng = np.random.default_rng(int(similarity * 100))
    pairs = 400
    sets = [s for _ in range(pairs) for s in planted_pair(similarity, 200, rng)]
    exact = [M.exact_jaccard(set(sets[2 * i].tolist()), set(sets[2 * i + 1].tolist())) for i in range(pairs)]
    offsets = np.zeros(len(sets) + 1, dtype=np.int64)
    np.cumsum([s.size for s in sets], out=offsets[1:])
    keys = M.band_keys(M.signatures(np.concatenate(sets), offsets))
    found = np.any(keys[0::2] == keys[1::2], axis=1)
    p = M.lsh_probability(np.array(exact))
    expected, sd = p.sum(), np.sqrt((p * (1 - p)).sum())
    print(f"s={similarity}: found {found.sum()}/{pairs}, S-curve expects {expected:.1f} +- {sd:.1f}")
    assert abs(found.sum() - expected) <= 4 * sd + 2


def test_lsh_probability_matches_published_14x8_table():
    p = M.lsh_probability(np.array([0.5, 0.7, 0.8, 0.85]))
    np.testing.assert_allclose(p, [0.053, 0.565, 0.924, 0.988], atol=1e-3)


def test_band_keys_require_bands_times_rows_equal_num_perm():
    with pytest.raises(ValueError, match="bands\\*rows"):
        M.band_keys(np.zeros((3, 112), np.uint32), bands=10, rows=10)


def test_bucket_edges_link_each_member_to_the_smallest_id():
    keys = np.array([5, 7, 5, 9, 5, 7], dtype=np.uint64)
    ids = np.array([10, 3, 4, 8, 2, 1])
    u, v = M.bucket_edges(keys, ids)
    assert sorted(zip(u.tolist(), v.tolist())) == [(1, 3), (2, 4), (2, 10)]


def reference_components(n: int, edges) -> list[int]:
    parent = list(range(n))

    def find(x):
        while parent[x] != x:
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return [find(x) for x in range(n)]


def test_union_find_roots_are_smallest_member_and_match_reference():
    rng = np.random.default_rng(0)
    for n, m in [(50, 20), (500, 400), (2000, 1900)]:
        u, v = rng.integers(0, n, m), rng.integers(0, n, m)
        uf = M.UnionFind(n)
        half = m // 2  # two union calls: clusters must merge across calls
        uf.union(u[:half], v[:half])
        uf.union(u[half:], v[half:])
        assert uf.roots().tolist() == reference_components(n, zip(u.tolist(), v.tolist()))


def test_simhash_near_duplicates_are_close_and_unrelated_are_far(stdlib_chunks):
    rng = random.Random(1)
    base = stdlib_chunks(40)
    near = [edit(t, 0.01, rng) for t in base]  # 3 of 300 words: ~3% of the 3-gram shingles change
    fps = M.simhash_fingerprints(base + near)
    close = M.hamming(fps[:40], fps[40:])
    far = M.hamming(fps[:20], fps[20:40])
    # Charikar: P(bit differs) = angle / pi; ~0.25 rad here -> ~5 of 64 bits; unrelated texts ~32.
    assert 2 <= np.mean(close) <= 8
    assert close.max() < far.min()
    assert np.mean(far) > 24


def test_simhash_edges_equal_all_pairs_comparison():
    rng = np.random.default_rng(3)
    fps = rng.integers(0, 2**63, 300, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, 300, dtype=np.uint64)
    for i in range(0, 120, 3):  # plant near copies at distance 0..4
        flips = rng.choice(64, i % 5, replace=False)
        fps[i + 1] = fps[i] ^ np.bitwise_or.reduce(np.uint64(1) << flips.astype(np.uint64), initial=np.uint64(0))
    ids = np.arange(300)
    u, v = M.simhash_edges(fps, ids, max_distance=3, blocks=4)
    uf = M.UnionFind(300)
    uf.union(u, v)
    brute = [(a, b) for a in range(300) for b in range(a + 1, 300) if M.hamming(fps[a], fps[b]) <= 3]
    assert len(brute) >= 30
    assert uf.roots().tolist() == reference_components(300, brute)
