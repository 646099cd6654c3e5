"""The in-process transport: every rank of a job is a thread of one process.

`InProcessNetwork(size)` holds one FIFO queue per (destination, tag) and the state of the
collectives; `network.endpoint(rank)` is that rank's `Transport` (hpc_tba.comm.transport), with
the MPI transport's semantics: messages are packed to bytes on `send` (so the receiver gets its
own copy, exactly as over the wire), sends never block and complete at once (`progress` is 0),
messages from one rank to another under one tag arrive in order, `receive` never blocks, the
collectives must be called by every rank in the same order (a rank calling another collective is
an error naming both), and `abort` ends every rank: each endpoint's next call raises
`TransportAborted`, and a rank waiting in a collective wakes up with it.

Used by hpc_tba.assembly.inprocess (the whole loop in one process) and by tests.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any

import numpy as np

from hpc_tba.comm.messages import Tag
from hpc_tba.comm.transport import MessageEndpoint


class TransportAborted(RuntimeError):
    """Some rank of the in-process job called `abort`."""


@dataclasses.dataclass
class _Collective:
    kind: str
    values: list[Any]
    filled: int = 0
    read: int = 0


class InProcessNetwork:
    """The shared state of an in-process job of `size` ranks."""

    def __init__(self, size: int, *, timeout_s: float = 1800.0) -> None:
        if size < 1:
            raise ValueError(f"an in-process job needs at least one rank, got {size}")
        self.size, self.timeout_s = size, timeout_s
        self._lock = threading.Condition()
        self._queues: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._collectives: dict[int, _Collective] = {}
        self.aborted: int | None = None
        self._endpoints: dict[int, InProcessTransport] = {}

    def endpoint(self, rank: int) -> InProcessTransport:
        """Rank `rank`'s transport (one per rank: asking twice returns the same endpoint)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not a rank of this {self.size}-rank in-process job")
        with self._lock:
            if rank not in self._endpoints:
                self._endpoints[rank] = InProcessTransport(self, rank)
            return self._endpoints[rank]

    # -- used by the endpoints -----------------------------------------------------------------
    def check(self) -> None:
        if self.aborted is not None:
            raise TransportAborted(f"the in-process job was aborted (code {self.aborted})")

    def put(self, src: int, dest: int, tag: Tag, buf: np.ndarray) -> None:
        with self._lock:
            self.check()
            self._queues[(dest, int(tag))].append((src, buf))

    def take(self, dest: int, tag: Tag, max_messages: int) -> list[tuple[int, np.ndarray]]:
        with self._lock:
            self.check()
            q, out = self._queues[(dest, int(tag))], []
            while q and len(out) < max_messages:
                out.append(q.popleft())
            return out

    def collective(self, seq: int, kind: str, rank: int, value: Any, *, root: int | None) -> list[Any]:
        """Enter collective number `seq` of rank `rank`; returns every rank's value once the
        ones it needs are in (all of them; only root's for a broadcast)."""
        with self._lock:
            self.check()
            c = self._collectives.setdefault(seq, _Collective(kind, [None] * self.size))
            if c.kind != kind:
                raise RuntimeError(f"rank {rank} called {kind} as collective #{seq}, but another rank "
                                   f"called {c.kind}: every rank must call the collectives in one order")
            if root is None or rank == root:
                c.values[rank] = value
                c.filled += 1
                self._lock.notify_all()
            need = self.size if root is None else 1
            if not self._lock.wait_for(lambda: c.filled >= need or self.aborted is not None, self.timeout_s):
                raise TimeoutError(f"rank {rank}: {kind} (collective #{seq}) waited {self.timeout_s:.0f} s "
                                   "for the other ranks")
            self.check()
            c.read += 1
            if c.read == self.size:
                del self._collectives[seq]
            return list(c.values)

    def abort(self, code: int) -> None:
        with self._lock:
            if self.aborted is None:
                self.aborted = code
            self._lock.notify_all()


class InProcessTransport(MessageEndpoint):
    """One rank's endpoint of an `InProcessNetwork` (build it with `network.endpoint(rank)`)."""

    def __init__(self, network: InProcessNetwork, rank: int) -> None:
        super().__init__()
        self.network, self.rank, self.size = network, rank, network.size
        self._seq = 0

    def _send_bytes(self, dest: int, tag: Tag, buf: np.ndarray) -> None:
        self.network.put(self.rank, dest, tag, np.array(buf, dtype=np.uint8, copy=True))

    def poll(self, tag: Tag, *, max_messages: int = 1 << 30) -> list[tuple[int, np.ndarray]]:
        return self.network.take(self.rank, tag, max_messages)

    def progress(self) -> int:
        self.network.check()
        return 0  # a send is complete once it is queued

    def flush(self) -> None:
        self.network.check()

    def _collective(self, kind: str, value: Any, *, root: int | None = None) -> list[Any]:
        self._seq += 1
        return self.network.collective(self._seq, kind, self.rank, value, root=root)

    def bcast_json(self, obj: Any, *, root: int = 0) -> Any:
        if not 0 <= root < self.size:
            raise ValueError(f"bcast_json root {root} is not a rank of this {self.size}-rank job")
        # Through JSON text, as over MPI: every rank gets its own copy, and a value MPI could
        # not carry fails here too.
        text = json.dumps(obj) if self.rank == root else None
        return json.loads(self._collective(f"bcast_json(root={root})", text, root=root)[root])

    def allgather_json(self, obj: Any) -> list[Any]:
        return [json.loads(t) for t in self._collective("allgather_json", json.dumps(obj))]

    def barrier(self) -> None:
        self._collective("barrier", None)

    def abort(self, code: int = 1) -> None:
        self.network.abort(code)
        raise TransportAborted(f"rank {self.rank} aborted the in-process job (code {code})")
