"""Trajectory messages: exact round trip through bytes, and malformed bytes refused clearly."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_tba.messages import TrajectoryBatch


@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6), with_ref=st.booleans(),
       pid=st.integers(0, 2**40), version=st.integers(0, 2**31))
def test_round_trip_is_exact(lengths, with_ref, pid, version):
    rng = np.random.default_rng(len(lengths))
    n = sum(lengths)
    b = TrajectoryBatch(prompt_id=pid, prompt_tokens=rng.integers(0, 50, 5).astype(np.int32),
                        response_tokens=rng.integers(0, 50, n).astype(np.int32),
                        lengths=np.array(lengths, np.int32), rewards=rng.random(len(lengths), np.float32),
                        logp_behavior=-rng.random(n, np.float32), policy_version=version, searcher_id=3,
                        timestamp=123.5, logp_ref=-rng.random(n, np.float32) if with_ref else None)
    u = TrajectoryBatch.unpack(b.pack())
    assert (u.prompt_id, u.policy_version, u.searcher_id, u.timestamp) == (pid, version, 3, 123.5)
    for f in ("prompt_tokens", "response_tokens", "lengths", "rewards", "logp_behavior"):
        np.testing.assert_array_equal(getattr(u, f), getattr(b, f))
    assert (u.logp_ref is None) == (not with_ref)
    assert [r.tolist() for r in u.responses()] == [r.tolist() for r in b.responses()]


def _batch():
    return TrajectoryBatch(1, np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32),
                           np.array([2, 3], np.int32), np.zeros(2, np.float32), np.zeros(5, np.float32),
                           0, 0, 0.0)


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:10], "shorter than its header"),
    (lambda b: b[:-4], "header says"),
    (lambda b: np.concatenate([np.zeros(4, np.uint8), b[4:]]), "not a trajectory message"),
])
def test_malformed_bytes_are_refused(mutate, message):
    with pytest.raises(ValueError, match=message):
        TrajectoryBatch.unpack(mutate(_batch().pack()))


def test_inconsistent_fields_are_refused():
    with pytest.raises(ValueError, match="lengths sum to 5"):
        TrajectoryBatch(1, np.arange(3, dtype=np.int32), np.arange(4, dtype=np.int32),
                        np.array([2, 3], np.int32), np.zeros(2, np.float32), np.zeros(4, np.float32), 0, 0, 0.0)
    with pytest.raises(ValueError, match="at least one token"):
        TrajectoryBatch(1, np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32),
                        np.array([3, 0], np.int32), np.zeros(2, np.float32), np.zeros(3, np.float32), 0, 0, 0.0)
