"""Per-token weight versions (in-flight updates): the trajectory message, the buffer shard, its
segment log, and the staleness statistics. Unit tests, no engine."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from buffer_helpers import make_batch

from hpc_tba.buffer import BufferShard
from hpc_tba.buffer.log import live_frames
from hpc_tba.comm.messages import SampledBatch, TrajectoryBatch
from hpc_tba.config import BufferConfig


def _mixed(pid: int, responses, versions, rewards=None) -> TrajectoryBatch:
    """A batch whose response j has per-token versions versions[j]."""
    b = make_batch(pid, responses, rewards or [0.5] * len(responses))
    tv = np.concatenate([np.asarray(v, np.int64) for v in versions])
    return TrajectoryBatch(prompt_id=b.prompt_id, prompt_tokens=b.prompt_tokens,
                           response_tokens=b.response_tokens, lengths=b.lengths, rewards=b.rewards,
                           logp_behavior=b.logp_behavior, policy_version=int(tv.min()),
                           searcher_id=0, timestamp=1.0, token_versions=tv)


def test_message_round_trip_with_and_without_token_versions():
    b = _mixed(3, [[1, 2, 3], [4, 5]], [[4, 4, 5], [5, 6]])
    back = TrajectoryBatch.unpack(b.pack())
    assert back.token_versions.tolist() == [4, 4, 5, 5, 6] and back.policy_version == 4
    plain = make_batch(3, [[1, 2, 3]], [1.0], version=7)
    packed = plain.pack()
    head = struct.calcsize("<IqqidB5q")
    assert len(packed) == head + 4 * (3 + 3 + 1 + 1 + 3)  # no per-token versions: none on the wire
    old = TrajectoryBatch.unpack(packed)
    assert old.token_versions is None and old.versions().tolist() == [7, 7, 7]
    with pytest.raises(ValueError, match="oldest token version"):
        TrajectoryBatch(**{**b.__dict__, "policy_version": 5})
    with pytest.raises(ValueError, match="token_versions has"):
        TrajectoryBatch(**{**b.__dict__, "token_versions": np.zeros(2, np.int64)})
    with pytest.raises(ValueError, match="header says"):
        TrajectoryBatch.unpack(b.pack()[:-4])


def test_on_policy_batch_keeps_token_versions():
    s = SampledBatch.from_trajectories([_mixed(0, [[1, 2], [3]], [[2, 3], [3]]),
                                        make_batch(1, [[4], [5, 6]], [0.0, 1.0], version=3)], k=2)
    assert s.policy_versions.tolist() == [2, 3, 3, 3]
    assert [v.tolist() for v in s.token_versions] == [[2, 3], [3], [3], [3, 3]]


def _rows(out: SampledBatch) -> dict[tuple, list[int]]:
    return {tuple(t.tolist()): v.tolist() for t, v in zip(out.response_tokens, out.row_token_versions())}


def test_shard_stores_token_versions_and_reports_token_staleness(tmp_path):
    cfg = BufferConfig(warm_start=0, sampler="uniform")
    shard = BufferShard(cfg, directory=str(tmp_path))
    shard.add(make_batch(0, [[10, 11]], [1.0], version=1))  # before any mixed response
    shard.add(_mixed(0, [[20, 21, 22, 23], [30]], [[1, 1, 2, 3], [3]]))
    shard.add(make_batch(0, [[40, 41, 42]], [0.0], version=3))  # after: its slot's version
    want = {(10, 11): [1, 1], (20, 21, 22, 23): [1, 1, 2, 3], (30,): [3], (40, 41, 42): [3, 3, 3]}
    out = shard.sample(1, 4, learner_version=4)
    assert _rows(out) == want
    oldest = {k: min(v) for k, v in want.items()}
    assert {tuple(t.tolist()): int(v) for t, v in zip(out.response_tokens, out.policy_versions)} == oldest
    m = shard.metrics()
    tokens = [x for v in want.values() for x in v]
    assert m["buffer/staleness_token_mean"] == pytest.approx(np.mean([4 - x for x in tokens]))
    assert m["buffer/staleness_mean"] == pytest.approx(np.mean([4 - x for x in oldest.values()]))
    assert m["buffer/staleness_max"] == 3 and m["buffer/version_span_max"] == 3
    shard.close()
    # the segment log replays the same per-token versions, and so does a compacted log
    again = BufferShard(cfg, directory=str(tmp_path))
    assert _rows(again.sample(1, 4, learner_version=4)) == want
    frames = list(live_frames(again.store))
    assert frames and again.store.ver.size
    again.close()


def test_unmixed_shard_allocates_no_version_pool():
    shard = BufferShard(BufferConfig(warm_start=0, sampler="uniform"))
    shard.add(make_batch(0, [[1, 2], [3]], [0.0, 1.0], version=2))
    out = shard.sample(1, 2, learner_version=2)
    assert shard.store.ver.size == 0 and out.token_versions is None
    assert shard.metrics()["buffer/staleness_token_mean"] == 0.0
