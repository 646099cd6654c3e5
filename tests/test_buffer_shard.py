"""BufferShard in memory: API contract, dedupe and capacity rules against a reference model."""
from __future__ import annotations

import numpy as np
import pytest
from buffer_helpers import make_batch, per_prompt, random_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_tba.buffer import (
    BufferShard,
    staleness_histogram,
    staleness_lags,
)
from hpc_tba.config import BufferConfig


def _cfg(**kw) -> BufferConfig:
    return BufferConfig(**{"warm_start": 0, **kw})


def test_rejects_prompt_of_another_shard():
    shard = BufferShard(_cfg(), shard_id=1, num_shards=3)
    with pytest.raises(ValueError, match="belongs to shard 2"):
        shard.add(make_batch(5, [[1, 2]], [1.0]))
    assert shard.add(make_batch(4, [[1, 2]], [1.0])) == 1


def test_warm_start_and_empty_sample():
    shard = BufferShard(_cfg(warm_start=3))
    assert shard.sample(2, 2, learner_version=0) is None
    shard.add(make_batch(0, [[1], [2]], [0.0, 1.0]))
    assert not shard.ready()
    shard.add(make_batch(1, [[3]], [0.0]))
    assert shard.ready() and len(shard) == 3


@pytest.mark.parametrize("sampler", ["tba", "uniform", "advantage"])
def test_sample_layout_and_rows_are_stored_responses(sampler):
    rng = np.random.default_rng(0)
    shard = BufferShard(_cfg(sampler=sampler, recency_m=0.5, inv_temp=1.0))
    added = {}
    for pid in range(6):
        b = random_batch(rng, pid, 5, vocab=1000, version=pid)
        shard.add(b, advantages=b.rewards - 0.1)
        logps = np.split(b.logp_behavior, np.cumsum(b.lengths)[:-1])
        added[pid] = {tuple(r.tolist()): (float(w), lp.tobytes())
                      for r, w, lp in zip(b.responses(), b.rewards, logps)}
    shard.mark_sync(3)
    out = shard.sample(4, 3, learner_version=10)
    assert out.size == 12 and out.group_ids.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    for g in range(4):  # one prompt per group
        assert len(set(out.prompt_ids[out.group_ids == g].tolist())) == 1
    if sampler != "advantage":  # A-LoL draws with replacement; the others keep prompts distinct
        assert len(set(out.prompt_ids.tolist())) == 4
    for i in range(out.size):
        pid = int(out.prompt_ids[i])
        reward, logp = added[pid][tuple(out.response_tokens[i].tolist())]
        assert out.rewards[i] == reward and out.logp_behavior[i].tobytes() == logp
        assert out.policy_versions[i] == pid and out.prompt_tokens[i][1] == pid
    assert out.advantages is not None and np.allclose(out.advantages, out.rewards - 0.1)
    m = shard.staleness(out, 10)
    assert m["buffer/staleness_max"] == 10 - out.policy_versions.min()
    assert m["buffer/staleness_mean"] == pytest.approx(float(np.mean(10 - out.policy_versions)))
    hist = staleness_histogram(out, 10)
    assert hist.sum() == 12 and np.array_equal(np.flatnonzero(hist),
                                               np.unique(staleness_lags(out, 10)))


def test_duplicates_keep_newest_and_count():
    shard = BufferShard(_cfg())
    assert shard.add(make_batch(0, [[1, 2], [3], [1, 2]], [0.25, 0.5, 0.75], version=0)) == 2
    assert shard.add(make_batch(0, [[3], [4]], [1.5, 2.5], version=1)) == 2
    assert per_prompt(shard)[0] == [((1, 2), 0.75, 0), ((3,), 1.5, 1), ((4,), 2.5, 1)]
    assert shard.metrics()["buffer/duplicates"] == 2
    # the same tokens under another prompt are not duplicates
    assert shard.add(make_batch(1, [[3]], [0.0])) == 1 and len(shard) == 4


def test_per_prompt_capacity_keeps_newest():
    shard = BufferShard(_cfg(per_prompt_capacity=100))
    for v in range(3):
        shard.add(make_batch(7, [[v, i] for i in range(60)], [0.0] * 60, version=v))
    rows = per_prompt(shard)[7]
    assert len(rows) == 100 and rows[0][0] == (1, 20) and rows[-1][0] == (2, 59)
    assert shard.metrics()["buffer/evicted"] == 80


def test_global_capacity_evicts_oldest_then_drops_empty_prompts():
    shard = BufferShard(_cfg(capacity=10))
    for pid in range(5):
        shard.add(make_batch(pid, [[pid, i] for i in range(4)], [0.0] * 4))
    assert len(shard) == 10 and sorted(per_prompt(shard)) == [2, 3, 4]
    assert len(per_prompt(shard)[2]) == 2 and shard.metrics()["buffer/prompts"] == 3


def test_global_capacity_lowest_reward():
    shard = BufferShard(_cfg(capacity=3, eviction="lowest_reward"))
    shard.add(make_batch(0, [[1], [2], [3]], [0.5, -1.0, 2.0]))
    shard.add(make_batch(1, [[4], [5]], [0.0, 3.0]))
    assert {r[0][0] for rows in per_prompt(shard).values() for r in rows} == {1, 3, 5}


def test_state_dict_restores_sampling_stream():
    rng = np.random.default_rng(1)
    batches = [random_batch(rng, p, 6) for p in range(8)]
    a, b = BufferShard(_cfg(), seed=3), BufferShard(_cfg(), seed=4)
    for x in batches:
        a.add(x)
        b.add(x)
    a.sample(2, 2, learner_version=0)
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        sa, sb = a.sample(3, 4, learner_version=1), b.sample(3, 4, learner_version=1)
        assert [t.tolist() for t in sa.response_tokens] == [t.tolist() for t in sb.response_tokens]


# ------------------------------------------------------------------ reference model
class Reference:
    """The rules of the issue, written as plainly as possible, one response at a time."""

    def __init__(self, cap: int, capacity: int, eviction: str) -> None:
        self.cap, self.capacity, self.eviction = cap, capacity, eviction
        self.rows: list[tuple[int, int, tuple, float, int]] = []  # (seq, pid, tokens, reward, v)
        self.seq = 0

    def add(self, pid: int, responses: list[tuple], rewards: list[float], version: int) -> int:
        last = {r: i for i, r in enumerate(responses)}
        batch = [(r, rewards[i]) for i, r in enumerate(responses) if last[r] == i][-self.cap:]
        tokens = {r for r, _ in batch}
        self.rows = [x for x in self.rows if not (x[1] == pid and x[2] in tokens)]
        mine = [x for x in self.rows if x[1] == pid]
        drop = {x[0] for x in mine[:max(0, len(mine) + len(batch) - self.cap)]}
        self.rows = [x for x in self.rows if x[0] not in drop]
        new = []
        for r, w in batch:
            new.append(self.seq)
            self.rows.append((self.seq, pid, r, w, version))
            self.seq += 1
        while self.capacity and len(self.rows) > self.capacity:
            key = (lambda x: x[0]) if self.eviction == "oldest" else (lambda x: (x[3], x[0]))
            self.rows.remove(min(self.rows, key=key))
        return sum(x[0] in new for x in self.rows)

    def per_prompt(self) -> dict[int, list[tuple]]:
        out: dict[int, list[tuple]] = {}
        for _, pid, r, w, v in self.rows:
            out.setdefault(pid, []).append((r, w, v))
        return out


batch_st = st.tuples(st.integers(0, 3),
                     st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3).map(tuple),
                              min_size=1, max_size=6))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(batch_st, min_size=1, max_size=25), cap=st.integers(1, 5),
       capacity=st.integers(0, 12), eviction=st.sampled_from(["oldest", "lowest_reward"]),
       compact_every=st.integers(1, 7))
def test_capacity_and_dedupe_match_reference(batches, cap, capacity, eviction, compact_every):
    shard = BufferShard(_cfg(per_prompt_capacity=cap, capacity=capacity, eviction=eviction))
    ref = Reference(cap, capacity, eviction)
    for i, (pid, responses) in enumerate(batches):
        rewards = [float((hash(r) + i) % 5) for r in responses]
        got = shard.add(make_batch(pid, [list(r) for r in responses], rewards, version=i))
        assert got == ref.add(pid, responses, rewards, i)
        if i % compact_every == 0:
            shard.store.compact()  # holes squeezed out mid-stream must change nothing
        assert per_prompt(shard) == ref.per_prompt()
        assert len(shard) == len(ref.rows)
