"""buffer.duplicates=count: one stored copy with its count, sampled as often as its copies; the
per-prompt cap counts copies; restart and compaction replay the same counts."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from buffer_helpers import make_batch, per_prompt, random_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_tba.buffer import BufferShard
from hpc_tba.config import BufferConfig


def _cfg(**kw) -> BufferConfig:
    return BufferConfig(**{"warm_start": 0, "fsync": "never", "duplicates": "count", **kw})


def _counts(shard: BufferShard) -> dict[int, list[tuple]]:
    """prompt id -> (tokens, reward, version, count) of its slots, oldest first."""
    st = shard.store
    return {pid: [(*row, int(st.s["count"][slot])) for row, slot in zip(rows, st.prompts[pid].slots.tolist())]
            for pid, rows in per_prompt(shard).items()}


def test_copies_are_counted_and_sampled_as_often_as_kept_copies():
    shard = BufferShard(_cfg())
    shard.add(make_batch(0, [[1, 2], [3], [1, 2]], [1.0, 0.0, 1.0], version=0))
    shard.add(make_batch(0, [[1, 2], [4]], [1.0, 0.0], version=1))
    # [1, 2] seen three times: one slot, the newest, count 3 (drop would keep it once)
    assert _counts(shard)[0] == [((3,), 0.0, 0, 1), ((1, 2), 1.0, 1, 3), ((4,), 0.0, 1, 1)]
    m = shard.metrics()
    assert m["buffer/size"] == 3 and m["buffer/copies"] == 5 and m["buffer/duplicates"] == 2
    batch = shard.sample(1, 5, learner_version=1)  # 5 copies, K=5: every copy once
    assert sorted(map(tuple, batch.response_tokens)) == [(1, 2)] * 3 + [(3,), (4,)]
    assert float(batch.rewards.mean()) == pytest.approx(0.6)
    drop = BufferShard(_cfg(duplicates="drop"))
    drop.add(make_batch(0, [[1, 2], [3], [1, 2]], [1.0, 0.0, 1.0], version=0))
    drop.add(make_batch(0, [[1, 2], [4]], [1.0, 0.0], version=1))
    assert drop.metrics()["buffer/copies"] == 3 and drop.ready()


def test_priority_sampling_follows_the_counts():
    shard = BufferShard(_cfg(recency_m=0.0), seed=3)
    shard.add(make_batch(0, [[7]] * 9 + [[8]], [1.0] * 9 + [0.0]))
    drawn = collections.Counter()
    for _ in range(400):
        drawn.update(tuple(t) for t in shard.sample(1, 1, learner_version=0).response_tokens)
    assert 0.8 < drawn[(7,)] / 400 < 0.98  # 9 of 10 copies


def test_warm_start_counts_copies():
    shard = BufferShard(_cfg(warm_start=4))
    shard.add(make_batch(0, [[1]] * 4, [0.0] * 4))
    assert len(shard) == 1 and shard.ready()


def test_config_names_the_rule():
    with pytest.raises(ValueError, match="buffer.duplicates='keep'"):
        BufferConfig(duplicates="keep")


class Reference:
    """duplicates=count written plainly: rows [seq, pid, tokens, reward, version, count]."""

    def __init__(self, cap: int, capacity: int) -> None:
        self.cap, self.capacity, self.rows, self.seq = cap, capacity, [], 0

    def add(self, pid, responses, rewards, version) -> int:
        last = {r: i for i, r in enumerate(responses)}
        n = collections.Counter(responses)
        batch = [[r, rewards[i], n[r]] for i, r in enumerate(responses) if last[r] == i]
        total, keep = 0, []
        for b in reversed(batch):  # the newest responses until their copies reach the cap
            if total >= self.cap:
                break
            keep.insert(0, b)
            total += b[2]
        for b in keep:  # a stored copy is replaced, its count inherited
            for x in [x for x in self.rows if x[1] == pid and x[2] == b[0]]:
                b[2] += x[5]
                self.rows.remove(x)
        budget = self.cap
        for i in range(len(keep) - 1, -1, -1):  # newest first, one copy left for each older one
            keep[i][2] = min(keep[i][2], budget - i)
            budget -= keep[i][2]
        mine = [x for x in self.rows if x[1] == pid]
        excess = sum(x[5] for x in mine) + sum(b[2] for b in keep) - self.cap
        while excess > 0:
            excess -= mine[0][5]
            self.rows.remove(mine.pop(0))
        new = []
        for r, w, c in keep:
            new.append(self.seq)
            self.rows.append([self.seq, pid, r, w, version, c])
            self.seq += 1
        while self.capacity and len(self.rows) > self.capacity:
            self.rows.remove(min(self.rows, key=lambda x: x[0]))
        return sum(x[0] in new for x in self.rows)

    def per_prompt(self):
        out = {}
        for _, pid, r, w, v, c in self.rows:
            out.setdefault(pid, []).append((r, w, v, c))
        return out


batch_st = st.tuples(st.integers(0, 3),
                     st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=2).map(tuple),
                              min_size=1, max_size=8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(batch_st, min_size=1, max_size=20), cap=st.integers(1, 6),
       capacity=st.integers(0, 10), compact_every=st.integers(1, 7))
def test_counts_match_reference(batches, cap, capacity, compact_every):
    shard = BufferShard(_cfg(per_prompt_capacity=cap, capacity=capacity))
    ref = Reference(cap, capacity)
    for i, (pid, responses) in enumerate(batches):
        rewards = [float(len(r) + i % 3) for r in responses]
        got = shard.add(make_batch(pid, [list(r) for r in responses], rewards, version=i))
        assert got == ref.add(pid, responses, rewards, i)
        if i % compact_every == 0:
            shard.store.compact()
        assert _counts(shard) == ref.per_prompt()
        assert shard.store.copies == sum(x[5] for x in ref.rows)
        assert all(sum(r[3] for r in rows) <= cap for rows in _counts(shard).values())


@pytest.mark.parametrize("capacity", [0, 40])
def test_restart_and_compaction_replay_the_same_counts(tmp_path, capacity):
    cfg = _cfg(capacity=capacity, per_prompt_capacity=5, compact_ratio=0.3)
    a = BufferShard(cfg, directory=str(tmp_path))
    rng = np.random.default_rng(0)
    for i in range(1400):
        pid = int(rng.integers(0, 30))
        a.add(random_batch(rng, pid, int(rng.integers(1, 7)), vocab=3, max_len=2, version=i))
        if i % 40 == 0:
            a.mark_sync(i)
    before, counters = _counts(a), {k: a.metrics()[f"buffer/{k}"] for k in a.store.counters}
    assert a.metrics()["buffer/compactions"] >= 1 and a.store.copies > len(a)
    a.close()
    b = BufferShard(cfg, directory=str(tmp_path))
    assert _counts(b) == before and b.store.copies == sum(c for rows in before.values() for *_, c in rows)
    assert {k: b.metrics()[f"buffer/{k}"] for k in b.store.counters} == counters
