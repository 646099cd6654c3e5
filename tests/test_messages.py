"""Messages: exact round trips through bytes, and malformed bytes refused with the problem named."""
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_tba.comm.messages import Done, EvalReport, ProbeReport, Stop, Tag, TrajectoryBatch


@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=6),
       pid=st.integers(0, 2**40), version=st.integers(0, 2**31))
def test_round_trip_is_exact(lengths, pid, version):
    rng = np.random.default_rng(len(lengths))
    n = sum(lengths)
    b = TrajectoryBatch(prompt_id=pid, prompt_tokens=rng.integers(0, 50, 5).astype(np.int32),
                        response_tokens=rng.integers(0, 50, n).astype(np.int32),
                        lengths=np.array(lengths, np.int32), rewards=rng.random(len(lengths), np.float32),
                        logp_behavior=-rng.random(n, np.float32), policy_version=version, searcher_id=3,
                        timestamp=123.5)
    u = TrajectoryBatch.unpack(b.pack())
    assert (u.prompt_id, u.policy_version, u.searcher_id, u.timestamp) == (pid, version, 3, 123.5)
    for f in ("prompt_tokens", "response_tokens", "lengths", "rewards", "logp_behavior"):
        np.testing.assert_array_equal(getattr(u, f), getattr(b, f))
    assert [r.tolist() for r in u.responses()] == [r.tolist() for r in b.responses()]


def _batch():
    return TrajectoryBatch(1, np.arange(3, dtype=np.int32), np.arange(5, dtype=np.int32),
                           np.array([2, 3], np.int32), np.zeros(2, np.float32), np.zeros(5, np.float32),
                           0, 0, 0.0)


def _tba1(b: TrajectoryBatch) -> np.ndarray:
    """The message older code sent: magic TBA1, six array sizes (the 6th: reference log-probs)."""
    head = struct.pack("<IqqidB6q", 0x54424131, b.prompt_id, b.policy_version, b.searcher_id, b.timestamp,
                       0, 3, 5, 2, 2, 5, 0)
    body = [b.prompt_tokens.astype("<i4"), b.response_tokens.astype("<i4"), b.lengths.astype("<i4"),
            b.rewards.astype("<f4"), b.logp_behavior.astype("<f4")]
    return np.frombuffer(head + b"".join(a.tobytes() for a in body), np.uint8)


def _with_flags(buf: np.ndarray, flags: int) -> np.ndarray:
    out = buf.copy()
    out[struct.calcsize("<Iqqid")] = flags
    return out


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:10], "shorter than its header"),
    (lambda b: b[:-4], "header says"),
    (lambda b: np.concatenate([np.zeros(4, np.uint8), b[4:]]), "not a trajectory message"),
    (lambda b: _with_flags(b, 1), "unknown flags 0x1"),
    (lambda b: _tba1(_batch()), "older TBA1 format"),
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


# ------------------------------------------------------------------ control messages
CONTROL = [EvalReport(7, 3, 5), EvalReport(0, 0, 0), Stop(12), Done(0), Done(2**40),
           ProbeReport(4, np.array([-0.5, -1.25, -3.0])), ProbeReport(0, np.zeros(0))]


@pytest.mark.parametrize("msg", CONTROL, ids=lambda m: type(m).__name__)
def test_control_round_trip_is_exact(msg):
    buf = msg.pack()
    assert buf.dtype == np.uint8 and buf.flags.c_contiguous
    back = type(msg).unpack(buf)
    if isinstance(msg, ProbeReport):
        assert back.policy_version == msg.policy_version and back.logp.dtype == np.float64
        np.testing.assert_array_equal(back.logp, msg.logp)
    else:
        assert back == msg
    assert type(msg).unpack(buf.tobytes()) is not None  # bytes as well as arrays


def test_every_message_type_has_its_own_tag():
    kinds = [TrajectoryBatch, EvalReport, Stop, Done, ProbeReport]
    assert sorted(k.TAG for k in kinds) == sorted(Tag)
    assert [Tag.TRAJ, Tag.EVAL, Tag.STOP, Tag.DONE, Tag.PROBE] == [11, 12, 13, 14, 15]  # the wire tags


@pytest.mark.parametrize("kind, buf, message", [
    (Stop, Done(3).pack(), "expected a STOP message, got DONE"),
    (EvalReport, Stop(3).pack()[:8], "EVAL message of 8 bytes is shorter than its 32-byte header"),
    (Done, np.concatenate([Done(3).pack(), np.zeros(8, np.uint8)]), "DONE message is 24 bytes, expected 16"),
    (Stop, np.zeros(16, np.uint8), "not a control message"),
    (Stop, _batch().pack(), "not a control message"),
    (ProbeReport, ProbeReport(1, np.ones(2)).pack()[:-3], "not a whole number of values"),
    (EvalReport, np.frombuffer(struct.pack("<IIqqq", 0x54424143, 99, 0, 0, 0), np.uint8), "got tag 99"),
])
def test_bad_control_buffers_name_the_problem(kind, buf, message):
    with pytest.raises(ValueError, match=message):
        kind.unpack(buf)


def test_control_fields_are_validated():
    with pytest.raises(ValueError, match="4 correct of 3"):
        EvalReport(1, 4, 3)
    with pytest.raises(ValueError, match="-1 trajectories"):
        Done(-1)
    with pytest.raises(ValueError, match="one array of tokens"):
        ProbeReport(1, np.zeros((2, 2)))
