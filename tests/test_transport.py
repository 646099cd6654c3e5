"""The Transport contract, run against both implementations: MPI (2 ranks under mpiexec: run
under the heavy lock) and in-process (2 threads). Both must observe exactly the same things.

    mpiexec -n 2 python tests/test_transport.py OUT.json    # what the MPI test runs
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hpc_tba.comm.messages import Done, EvalReport, ProbeReport, Stop, TrajectoryBatch  # noqa: E402


def _traj(i: int) -> TrajectoryBatch:
    return TrajectoryBatch(prompt_id=2 * i, prompt_tokens=np.arange(3, dtype=np.int32) + i,
                           response_tokens=np.full(i + 1, i, np.int32), lengths=np.array([i + 1], np.int32),
                           rewards=np.array([0.5 * i], np.float32), logp_behavior=-np.ones(i + 1, np.float32),
                           policy_version=i, searcher_id=1, timestamp=float(i))


def _wait(t, kind, n: int, *, timeout_s: float = 60.0, **kw) -> list:
    """Poll until n messages of `kind` arrived (messages are asynchronous on every transport)."""
    out, deadline = [], time.time() + timeout_s
    while len(out) < n:
        got = t.receive(kind, **kw)
        out += got
        if not got:
            if time.time() > deadline:
                raise TimeoutError(f"rank {t.rank}: {len(out)} of {n} {kind.__name__} messages")
            time.sleep(0.001)
    return out


def contract(t) -> dict:
    """One rank's side of the contract (rank 1 plays a searcher, rank 0 learner rank 0); returns
    what this rank observed, identical on every implementation."""
    from hpc_tba.comm.transport import Transport

    assert isinstance(t, Transport) and t.size == 2 and t.rank in (0, 1)
    seen: dict = {"rank": t.rank, "gather": t.allgather_json({"rank": t.rank, "name": f"r{t.rank}"})}
    seen["bcast0"] = t.bcast_json({"manifest": [1, 2, 3]} if t.rank == 0 else None)
    seen["bcast1"] = t.bcast_json(["from", 1] if t.rank == 1 else None, root=1)
    seen["empty"] = [len(t.receive(k)) for k in (TrajectoryBatch, EvalReport, Stop, Done, ProbeReport)]
    try:
        t.send(2, Stop(0))
    except ValueError as e:
        seen["bad_dest"] = "not a rank" in str(e)
    t.barrier()
    if t.rank == 1:
        for i in range(5):
            t.send(0, _traj(i))
        t.send(0, EvalReport(3, 2, 4))
        t.send(0, ProbeReport(3, np.array([-0.25, -2.0])))
        stop = _wait(t, Stop, 1)
        seen["stop"] = [(src, m.policy_version) for src, m in stop]
        t.flush()
        t.send(0, Done(t.sent_to[0]))
        t.flush()
        seen["after_flush"] = t.progress()
        seen["sent_to"] = {str(k): v for k, v in t.sent_to.items()}
    else:
        first = _wait(t, TrajectoryBatch, 2, max_messages=2)  # max_messages holds: at most 2 a call
        rest = _wait(t, TrajectoryBatch, 3)
        seen["traj"] = [(src, b.prompt_id, b.policy_version, b.response_tokens.tolist()) for src, b in first + rest]
        seen["eval"] = [(src, m.policy_version, m.correct, m.total) for src, m in _wait(t, EvalReport, 1)]
        seen["probe"] = [(src, m.policy_version, m.logp.tolist()) for src, m in _wait(t, ProbeReport, 1)]
        t.send(1, Stop(9))
        seen["done"] = [(src, m.sent) for src, m in _wait(t, Done, 1)]
        t.flush()
        seen["sent_to"] = {str(k): v for k, v in t.sent_to.items()}  # control messages do not count
    t.barrier()
    seen["leftover"] = [len(t.receive(k)) for k in (TrajectoryBatch, EvalReport, Stop, Done, ProbeReport)]
    return seen


EXPECTED = [
    {"rank": 0, "gather": [{"rank": 0, "name": "r0"}, {"rank": 1, "name": "r1"}], "bcast0": {"manifest": [1, 2, 3]},
     "bcast1": ["from", 1], "empty": [0] * 5, "bad_dest": True,
     "traj": [[1, 2 * i, i, [i] * (i + 1)] for i in range(5)], "eval": [[1, 3, 2, 4]],
     "probe": [[1, 3, [-0.25, -2.0]]], "done": [[1, 5]], "sent_to": {}, "leftover": [0] * 5},
    {"rank": 1, "gather": [{"rank": 0, "name": "r0"}, {"rank": 1, "name": "r1"}], "bcast0": {"manifest": [1, 2, 3]},
     "bcast1": ["from", 1], "empty": [0] * 5, "bad_dest": True, "stop": [[0, 9]],
     "after_flush": 0, "sent_to": {"0": 5}, "leftover": [0] * 5},
]


def _json(x):
    return json.loads(json.dumps(x))  # tuples -> lists, as both sides report them


def run_in_process() -> list[dict]:
    from hpc_tba.comm.inprocess import InProcessNetwork

    net = InProcessNetwork(2, timeout_s=60)
    out: list = [None, None]
    errors: list = []

    def rank(r: int) -> None:
        try:
            out[r] = contract(net.endpoint(r))
        except BaseException as e:  # reported by the test, not lost in the thread
            errors.append(e)
            net.abort(1)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    if errors:
        raise errors[0]
    return _json(out)


def test_in_process_transport_meets_the_contract():
    assert run_in_process() == EXPECTED


def test_mpi_transport_meets_the_contract_and_matches_in_process(tmp_path):
    from hpc_tba.launcher.local import find_mpiexec, rank_env

    mpiexec = find_mpiexec("mpiexec")
    assert mpiexec is not None, "mpiexec not found"
    out = tmp_path / "mpi.json"
    env = rank_env(1)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__), str(out)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got == EXPECTED
    assert got == run_in_process()


def test_bench_transport_prints_its_figures():
    """tools/bench_transport.py at a tiny size: its lines, no thresholds (a shared machine)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_transport.py"), "--messages", "20",
                          "--responses", "4", "--tokens", "16", "--prompt", "8", "--repeats", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("raw/exchange") == 2 and "mpi exchange / raw mpi4py = " in out.stdout
    float(out.stdout.strip().splitlines()[-1].rsplit("=", 1)[1])


def test_in_process_collectives_in_another_order_are_named_and_abort_reaches_every_rank():
    from hpc_tba.comm.inprocess import InProcessNetwork, TransportAborted

    net = InProcessNetwork(2, timeout_s=30)
    a, b = net.endpoint(0), net.endpoint(1)
    seen: dict = {}

    def other() -> None:
        try:
            b.barrier()
        except RuntimeError as e:
            seen["b"] = str(e)

    th = threading.Thread(target=other)
    th.start()
    time.sleep(0.05)
    with pytest.raises(RuntimeError, match="called bcast_json.*another rank called barrier"):
        a.bcast_json(1)
    # b waits in its barrier for a rank that will never come: an abort wakes it.
    with pytest.raises(TransportAborted):
        a.abort(3)
    th.join(10)
    assert not th.is_alive() and "aborted" in seen["b"]
    with pytest.raises(TransportAborted, match="code 3"):
        b.receive(Stop)
    with pytest.raises(ValueError, match="rank 2 is not a rank"):
        net.endpoint(2)


def test_in_process_receiver_gets_its_own_copy():
    from hpc_tba.comm.inprocess import InProcessNetwork

    net = InProcessNetwork(2)
    b = _traj(2)
    net.endpoint(1).send(0, b)
    b.response_tokens[:] = -7  # the sender reuses its buffer: the message already left
    (_, got), = net.endpoint(0).receive(TrajectoryBatch)
    assert got.response_tokens.tolist() == [2, 2, 2]


def _mpi_main(path: str) -> int:
    from hpc_tba.comm.transport import MPITransport

    t = MPITransport()
    seen = contract(t)
    everyone = t.allgather_json(seen)
    if t.rank == 0:
        with open(path, "w") as f:
            json.dump(everyone, f)
    return 0


if __name__ == "__main__":
    sys.exit(_mpi_main(sys.argv[1]))
