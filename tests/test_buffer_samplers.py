"""Sampler distributions (ALGORITHMS.md §1, §3), checked by frequency against exact probabilities.

Each test draws a few thousand batches with a seeded generator and compares empirical frequencies
with the exact probability under a 6-sigma binomial bound, so a wrong distribution fails and a
right one fails with probability below 1e-8 per comparison.
"""
from __future__ import annotations

import itertools

import numpy as np
from buffer_helpers import make_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_tba.buffer import BufferShard
from hpc_tba.buffer.samplers import choose_rows
from hpc_tba.config import BufferConfig

DRAWS = 3000


def _close(freq: np.ndarray, p: np.ndarray, draws: int) -> bool:
    sigma = np.sqrt(np.maximum(p * (1 - p), 1e-12) / draws)
    return bool(np.all(np.abs(freq - p) <= 6 * sigma + 1e-9))


def _successive_inclusion(w: np.ndarray, k: int) -> np.ndarray:
    """Exact inclusion probabilities of sampling k of len(w) without replacement ∝ w."""
    incl = np.zeros(w.size)
    for seq in itertools.permutations(range(w.size), k):
        p, left = 1.0, w.sum()
        for i in seq:
            p *= w[i] / left
            left -= w[i]
        incl[list(seq)] += p
    return incl


@settings(max_examples=12, deadline=None)
@given(n=st.integers(2, 5), k=st.integers(1, 3), seed=st.integers(0, 2**31),
       logits=st.lists(st.floats(-2, 2), min_size=5, max_size=5), weighted=st.booleans())
def test_choose_rows_matches_successive_sampling(n, k, seed, logits, weighted):
    rng = np.random.default_rng(seed)
    lg = np.array(logits[:n]) if weighted else None
    counts = np.zeros(n)
    for _ in range(DRAWS):
        idx = choose_rows(n, k, rng, lg)
        assert idx.size == k
        if n >= k:
            assert len(set(idx.tolist())) == k  # without replacement when enough rows
        else:
            assert set(idx.tolist()) == set(range(n))  # each row once, then the fill
        counts[np.unique(idx)] += 1
    if n > k:
        w = np.exp(lg - lg.max()) if weighted else np.ones(n)
        assert _close(counts / DRAWS, _successive_inclusion(w, k), DRAWS)


def _shard(sampler: str, **kw) -> BufferShard:
    return BufferShard(BufferConfig(sampler=sampler, warm_start=0, **kw), seed=7)


@settings(max_examples=6, deadline=None)
@given(inv_temp=st.floats(0.0, 2.0), rewards=st.lists(st.floats(-1, 1), min_size=4, max_size=4))
def test_reward_priority_is_softmax(inv_temp, rewards):
    shard = _shard("tba", recency_m=0.0, inv_temp=inv_temp)
    r = np.array(rewards, dtype=np.float32)
    shard.add(make_batch(0, [[i] for i in range(4)], r))
    counts = np.zeros(4)
    for _ in range(DRAWS):
        counts[shard.sample(1, 1, learner_version=0).response_tokens[0][0]] += 1
    p = np.exp(inv_temp * r.astype(np.float64))
    assert _close(counts / DRAWS, p / p.sum(), DRAWS)


@settings(max_examples=6, deadline=None)
@given(m=st.floats(0.0, 1.0), k=st.integers(1, 4))
def test_recency_slots_have_probability_m_and_take_newest(m, k):
    shard = _shard("tba", recency_m=m)
    for pid in range(20):  # old prompts, then a sync, then 10 refreshed ones
        shard.add(make_batch(pid, [[pid, j] for j in range(5)], [0.0] * 5, version=0))
    shard.mark_sync(1)
    for pid in range(10):
        shard.add(make_batch(pid, [[100 + pid, j] for j in range(3)], [0.0] * 3, version=1))
    recent, draws = 0.0, 1500
    for _ in range(draws):
        shard.sample(4, k, learner_version=1)
        recent += shard.metrics()["buffer/sample_recent_frac"]
    assert _close(np.array([recent / draws]), np.array([m]), 4 * draws)
    # a recency slot is a refreshed prompt and its K newest rows (all 8, then a fill, if K > 8)
    shard.cfg.recency_m = 1.0
    for k2 in (k, 9):
        out = shard.sample(4, k2, learner_version=1)
        for g in range(4):
            rows = [t.tolist() for t, gid in zip(out.response_tokens, out.group_ids) if gid == g]
            pid = int(out.prompt_ids[out.group_ids == g][0])
            every = [[pid, j] for j in range(5)] + [[100 + pid, j] for j in range(3)]
            assert pid < 10 and len(rows) == k2
            if k2 <= 8:
                assert rows == every[-k2:]
            else:
                assert sorted(map(tuple, rows[:8])) == sorted(map(tuple, every))
                assert tuple(rows[8]) in set(map(tuple, every))


def test_recency_falls_back_to_previous_interval_right_after_sync():
    shard = _shard("tba", recency_m=1.0)
    shard.add(make_batch(0, [[1], [2]], [0.0, 0.0]))
    shard.add(make_batch(1, [[3], [4]], [0.0, 0.0]))
    shard.mark_sync(1)
    shard.add(make_batch(1, [[5]], [0.0]))
    assert {int(shard.sample(1, 1, learner_version=1).prompt_ids[0]) for _ in range(50)} == {1}
    shard.mark_sync(2)  # nothing refreshed since: use the interval before
    assert {tuple(shard.sample(1, 1, learner_version=2).response_tokens[0]) for _ in range(50)} \
        == {(5,)}


@settings(max_examples=6, deadline=None)
@given(adv=st.lists(st.floats(-1, 2), min_size=6, max_size=6).filter(lambda a: max(a) > 0.05))
def test_advantage_sampler_is_proportional_to_positive_advantage(adv):
    shard = _shard("advantage")
    a = np.array(adv, dtype=np.float32)
    shard.add(make_batch(0, [[i] for i in range(3)], [0.0] * 3), advantages=a[:3])
    shard.add(make_batch(1, [[i] for i in range(3, 6)], [0.0] * 3), advantages=a[3:])
    counts = np.zeros(6)
    for _ in range(DRAWS):
        counts[shard.sample(1, 1, learner_version=0).response_tokens[0][0]] += 1
    w = np.maximum(a.astype(np.float64), 0)
    assert np.all(counts[w == 0] == 0)  # negative advantages are never trained on
    assert _close(counts / DRAWS, w / w.sum(), DRAWS)


def test_uniform_sampler_picks_prompts_and_rows_uniformly():
    shard = _shard("uniform", recency_m=1.0, inv_temp=5.0)  # both ignored by "uniform"
    for pid in range(5):
        shard.add(make_batch(pid, [[pid, j] for j in range(4)], [float(j) for j in range(4)]))
    shard.mark_sync(1)
    shard.add(make_batch(0, [[0, 9]], [9.0]))
    counts = np.zeros((5, 10))
    for _ in range(DRAWS):
        out = shard.sample(2, 2, learner_version=0)
        assert out.prompt_ids[0] != out.prompt_ids[2]
        for t in out.response_tokens:
            counts[t[0], t[1]] += 1
    prompt_freq = counts.sum(1) / (4 * DRAWS)
    assert _close(prompt_freq, np.full(5, 0.2), DRAWS)
    row_freq = counts[1, :4] / counts[1].sum()  # within a prompt: 2 of 4 rows, uniform
    assert _close(row_freq, np.full(4, 0.25), int(counts[1].sum()) // 2)
