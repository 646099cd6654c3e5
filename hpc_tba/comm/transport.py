"""Message transport between roles: the `Transport` protocol and its MPI implementation.

What crosses it is a typed message of hpc_tba.comm.messages (trajectories, EVAL, STOP, DONE, PROBE:
the table is there), packed to raw bytes, never pickled, plus one JSON broadcast / all-gather at
setup (addresses, the weight manifest). Roles are typed to `Transport`; `MPITransport` runs a job
of processes, `hpc_tba.comm.inprocess.InProcessTransport` runs every rank as a thread of one
process (debugging, unit tests) with the same semantics:

- `send` never blocks; messages between one pair of ranks under one tag arrive in order;
- `receive` never blocks: it returns what has arrived (up to `max_messages`), as (source, message);
- `bcast_json`, `allgather_json` and `barrier` are collective: every rank calls them, in the same
  order;
- `abort` ends every rank of the job (a lost rank must not leave the others hanging).

MPI sends are `Isend` with the buffer kept alive until the request completes; receives poll with
`Iprobe` so a learner never blocks on a given searcher.
"""
from __future__ import annotations

import json
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from hpc_tba.comm.messages import Message, Tag, TrajectoryBatch

M = TypeVar("M", bound=Message)


@runtime_checkable
class Transport(Protocol):
    """What a role needs from the layer that carries its messages."""

    rank: int
    """This rank's index in the job (0 = learner rank 0)."""
    size: int
    """Ranks in the job."""
    sent_to: dict[int, int]
    """Trajectory messages this rank has sent, by destination (a searcher's DONE counts)."""

    def send(self, dest: int, message: Message) -> None:
        """Send one message to rank `dest` without blocking (it travels under `message.TAG`)."""

    def receive(self, kind: type[M], *, max_messages: int = 1 << 30) -> list[tuple[int, M]]:
        """Up to `max_messages` messages of type `kind` that have arrived, as (source, message);
        never blocks."""

    def progress(self) -> int:
        """Drive sends forward; returns how many of this rank's sends are still in flight."""

    def flush(self) -> None:
        """Block until every send of this rank has completed."""

    def bcast_json(self, obj: Any, *, root: int = 0) -> Any:
        """`obj` of rank `root` on every rank (collective; JSON-able values; setup only)."""

    def allgather_json(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (collective; setup only)."""

    def barrier(self) -> None:
        """Wait until every rank has called it (collective)."""

    def abort(self, code: int = 1) -> None:
        """End every rank of the job."""


class MessageEndpoint:
    """Typed sends and receives over an implementation's raw bytes (`_send_bytes`, `poll`)."""

    rank: int
    size: int

    def __init__(self) -> None:
        self.sent_to: dict[int, int] = {}

    def send(self, dest: int, message: Message) -> None:
        if not 0 <= dest < self.size:
            raise ValueError(f"rank {self.rank}: destination {dest} is not a rank of this {self.size}-rank job")
        self._send_bytes(dest, message.TAG, message.pack())
        if isinstance(message, TrajectoryBatch):
            self.sent_to[dest] = self.sent_to.get(dest, 0) + 1

    def receive(self, kind: type[M], *, max_messages: int = 1 << 30) -> list[tuple[int, M]]:
        # Every polled buffer is this receiver's own (fresh per message), so a trajectory's
        # arrays can be views into it: unpacking copies nothing (tools/bench_transport.py).
        views = {"copy": False} if kind is TrajectoryBatch else {}
        return [(src, kind.unpack(buf, **views)) for src, buf in self.poll(kind.TAG, max_messages=max_messages)]

    def _send_bytes(self, dest: int, tag: Tag, buf: np.ndarray) -> None:
        raise NotImplementedError

    def poll(self, tag: Tag, *, max_messages: int = 1 << 30) -> list[tuple[int, np.ndarray]]:
        """Raw messages of `tag` that have arrived, as (source, uint8 bytes); never blocks."""
        raise NotImplementedError


class MPITransport(MessageEndpoint):
    """Point-to-point messages over MPI.COMM_WORLD (mpi4py, buffers not pickles)."""

    PROBE_RETRIES = 16
    """Consecutive empty probes before `poll` gives up (each one drives MPI progress)."""

    def __init__(self) -> None:
        from mpi4py import MPI

        super().__init__()
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._pending: list[tuple[Any, np.ndarray]] = []

    # -- sending -------------------------------------------------------------------------------
    def _send_bytes(self, dest: int, tag: Tag, buf: np.ndarray) -> None:
        buf = np.ascontiguousarray(buf)
        req = self.comm.Isend([buf, self._mpi.BYTE], dest=dest, tag=int(tag))
        self._pending.append((req, buf))
        self.progress()

    def progress(self) -> int:
        """Retire completed sends; returns how many are still in flight."""
        self._pending = [(r, b) for r, b in self._pending if not r.Test()]
        return len(self._pending)

    def flush(self) -> None:
        """Block until every send of this rank has completed."""
        for req, _ in self._pending:
            req.Wait()
        self._pending.clear()

    # -- receiving -----------------------------------------------------------------------------
    def poll(self, tag: Tag, *, max_messages: int = 1 << 30) -> list[tuple[int, np.ndarray]]:
        """Receive up to `max_messages` waiting messages of `tag` without blocking: (source, bytes).

        MPICH moves queued eager messages forward only inside MPI calls, and one Iprobe sees at
        most the message that the previous call made visible: a single `while Iprobe` loop stalls
        at ~1 message per poll while hundreds wait (measured: 436 queued, 1 received per poll).
        So a miss is retried a few times, each retry driving progress, before giving up.
        """
        MPI, out, misses = self._mpi, [], 0
        status = MPI.Status()
        while len(out) < max_messages and misses < self.PROBE_RETRIES:
            if not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=int(tag), status=status):
                misses += 1
                continue
            misses = 0
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            src = status.Get_source()
            self.comm.Recv([buf, MPI.BYTE], source=src, tag=int(tag))
            out.append((src, buf))
        return out

    # -- collectives ---------------------------------------------------------------------------
    def bcast_json(self, obj: Any, *, root: int = 0) -> Any:
        """Broadcast a JSON-able object from `root` to every rank (collective; setup only)."""
        MPI = self._mpi
        data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8) if self.rank == root else None
        n = np.array([0 if data is None else data.size], dtype=np.int64)
        self.comm.Bcast([n, MPI.INT64_T], root=root)
        buf = data.copy() if data is not None else np.empty(int(n[0]), dtype=np.uint8)
        self.comm.Bcast([buf, MPI.BYTE], root=root)
        return json.loads(buf.tobytes().decode())

    def allgather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able `obj`, in rank order (collective; setup only)."""
        MPI = self._mpi
        mine = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()
        counts = np.zeros(self.size, dtype=np.int64)
        self.comm.Allgather([np.array([mine.size], dtype=np.int64), MPI.INT64_T], [counts, MPI.INT64_T])
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
        out = np.empty(int(counts.sum()), dtype=np.uint8)
        self.comm.Allgatherv([mine, MPI.BYTE], [out, (counts.tolist(), offsets.tolist()), MPI.BYTE])
        return [json.loads(out[o:o + c].tobytes().decode()) for o, c in zip(offsets, counts)]

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, code: int = 1) -> None:
        """End every rank of the job (a lost rank must not leave the others hanging)."""
        self.comm.Abort(code)
