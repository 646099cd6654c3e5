"""Benchmark: the MPI trajectory exchange (MPITransport, as searchers and learners use it) against
raw mpi4py sends of the same bytes.

    python tools/bench_transport.py [--messages 4000] [--responses 24] [--tokens 512] [--prompt 256]
        [--repeats 5]

Starts itself under `mpiexec -n 2` (rank 1 the searcher, rank 0 the learner). Per trial both
ranks meet at a barrier, then:

- exchange: rank 1 sends `--messages` TrajectoryBatch messages of `--responses` responses of
  `--tokens` tokens each (+ a `--prompt`-token prompt) with `MPITransport.send` (packing each
  message, Isend) and flushes; rank 0 polls as the learner's `receive` does (trajectories, then
  the DONE tag, the same probe rule) and unpacks every message, until it has them all;
- raw: rank 1 Isends the same packed bytes (a copy per message, packed beforehand) and waits
  for them all; rank 0 posts a blocking `Recv` of the known size into a fresh buffer for each:
  the least an exchange of messages that the receiver keeps can cost.

Time: rank 0's, from the barrier to the last message received (median of `--repeats` trials,
exchange and raw alternating so both see the same machine load). The last line is raw time /
exchange time (1 = no overhead; goal >= 0.5); a line per message size also gives messages/s and
MB/s. Measured on a shared machine: only the ratios mean something.

Measured (2026-12-02, 2 shared cores, MPICH): 100 kB messages 0.52-0.70 on a quiet machine
(0.3-0.55 at load average 40-80); 0.8 kB messages (the embedded task's) 0.11-0.13, i.e. ~40,000
messages/s against raw's ~320,000: ~20 µs of Python per message, mostly unpack's dataclass
construction and checks, far above what searchers send. Unpacking into views of the received
buffer (no copies) raised the 100 kB median from 0.42 to 0.53 (3 trials each, under load).
Measured (2026-12-04, 2-core AMD EPYC, each run alone on the cores): with the old default of 400
messages a trial, 0.31 / 0.72 / 0.66 in three runs (a raw trial of 100 kB messages lasted ~10 ms);
with 4000 messages and 5 trials, now the default, 0.585 / 0.658 / 0.658 (exchange 27.6-28.6k
messages/s = 2.8 GB/s, raw 43-47k); 0.8 kB messages 0.17-0.23 (~58k messages/s against raw's
260-340k). Tried and left out: one Testsome for all pending sends instead of a Test each: slower for 100 kB
messages (above the eager limit a send needs the sender's progress, which every Test drives).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_message(responses: int, tokens: int, prompt: int, seed: int = 0):
    import numpy as np

    from hpc_tba.comm.messages import TrajectoryBatch

    rng = np.random.default_rng(seed)
    n = responses * tokens
    return TrajectoryBatch(prompt_id=7, prompt_tokens=rng.integers(3, 30000, prompt).astype(np.int32),
                           response_tokens=rng.integers(3, 30000, n).astype(np.int32),
                           lengths=np.full(responses, tokens, dtype=np.int32),
                           rewards=rng.random(responses).astype(np.float32),
                           logp_behavior=-rng.random(n).astype(np.float32), policy_version=3,
                           searcher_id=0, timestamp=time.time())


def exchange_trial(t, batch, count: int) -> float:
    """MPITransport send / receive of `count` messages; rank 0's seconds."""
    from hpc_tba.comm.messages import Done, TrajectoryBatch

    t.barrier()
    t0 = time.perf_counter()
    if t.rank == 1:
        for _ in range(count):
            t.send(0, batch)
        t.flush()
        got = 0
    else:
        got = 0
        while got < count:  # the learner's receive: trajectories, then the other tags
            got += len(t.receive(TrajectoryBatch))
            t.receive(Done)
    dt = time.perf_counter() - t0
    t.barrier()
    return dt if t.rank == 0 else 0.0


def raw_trial(comm, MPI, buf, count: int) -> float:
    """Raw mpi4py of the same bytes: Isend of `count` pre-packed copies (distinct buffers, as
    distinct messages are) / a blocking Recv of the known size into a fresh buffer each (a
    receiver keeps its messages); rank 0's seconds."""
    import numpy as np

    from hpc_tba.comm.messages import Tag

    bufs = [buf.copy() for _ in range(count)] if comm.Get_rank() == 1 else []
    comm.Barrier()
    t0 = time.perf_counter()
    if comm.Get_rank() == 1:
        reqs = [comm.Isend([b, MPI.BYTE], dest=0, tag=int(Tag.TRAJ)) for b in bufs]
        MPI.Request.Waitall(reqs)
    else:
        for _ in range(count):
            comm.Recv([np.empty(buf.nbytes, dtype=np.uint8), MPI.BYTE], source=1, tag=int(Tag.TRAJ))
    dt = time.perf_counter() - t0
    comm.Barrier()
    return dt


def child(a) -> int:
    from hpc_tba.comm.transport import MPITransport

    t = MPITransport()
    if t.size != 2:
        raise SystemExit(f"bench_transport needs 2 ranks, got {t.size}")
    sizes = [(a.responses, a.tokens, a.prompt)] + ([(10, 8, 12)] if not a.one_size else [])
    results = []
    for responses, tokens, prompt in sizes:
        batch = make_message(responses, tokens, prompt)
        buf = batch.pack().copy()
        exchange_trial(t, batch, min(a.messages, 20))  # warm-up: connections, allocations
        raw_trial(t.comm, t._mpi, buf, min(a.messages, 20))
        ex, raw = [], []
        for _ in range(a.repeats):
            ex.append(exchange_trial(t, batch, a.messages))
            raw.append(raw_trial(t.comm, t._mpi, buf, a.messages))
        results.append((responses, tokens, prompt, buf.nbytes, statistics.median(ex), statistics.median(raw)))
    if t.rank == 0:
        for responses, tokens, prompt, nbytes, ex, raw in results:
            mb = nbytes * a.messages / 1e6
            print(f"  {responses} x {tokens} tokens (+{prompt} prompt), {nbytes / 1e3:.1f} kB a message, "
                  f"{a.messages} messages: exchange {a.messages / ex:9.0f} msg/s {mb / ex:8.1f} MB/s | raw "
                  f"{a.messages / raw:9.0f} msg/s {mb / raw:8.1f} MB/s | raw/exchange {raw / ex:.3g}", flush=True)
        *_, ex, raw = results[0]
        print(f"mpi exchange / raw mpi4py = {raw / ex:.3g}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=4000,
                    help="messages a trial (400 made a raw trial of 100 kB messages ~10 ms: too short to time)")
    ap.add_argument("--responses", type=int, default=24, help="responses a message (TBA's GSM8K S = 1.2 K)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens a response")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one-size", action="store_true", help="skip the embedded task's small messages")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    from hpc_tba.launcher.local import find_mpiexec

    mpiexec = find_mpiexec("mpiexec")
    if mpiexec is None:
        raise SystemExit("bench_transport: mpiexec not found (the mpich wheel installs it next to python)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # no torch: none is imported
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [sys.path[0], env.get("PYTHONPATH")]))
    print(f"bench_transport: 2 ranks under {os.path.basename(mpiexec)}, {a.messages} messages a trial, "
          f"median of {a.repeats} trials", flush=True)
    out = subprocess.run([mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__), "--child",
                          *sys.argv[1:]], env=env, capture_output=True, text=True, timeout=a.timeout)
    sys.stdout.write(out.stdout)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-3000:])
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
