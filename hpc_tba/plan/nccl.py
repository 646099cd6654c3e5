"""The planner's NCCL rows: the device buffers NCCL allocates for the communicators a GPU is in.

They live outside torch's caching allocator, so no torch figure shows them (the smoke job's
verdict prints the device's own used memory beside torch's peak for that reason). Per
communicator, NCCL keeps for every channel and every connection a rank receives on one buffer
per protocol: Simple (`NCCL_BUFFSIZE`, 4 MiB), LL (`NCCL_LL_BUFFSIZE`, 8 lines x 512 threads x 8
steps x 16 B = 512 KiB) and LL128 (`NCCL_LL128_BUFFSIZE`, 120 elements x 640 threads x 8 steps x
8 B = 4.6875 MiB), together rounded up to the 2 MiB granularity of NCCL's cuMem allocations:
10 MiB per connection and channel at the defaults (the 10,485,760-byte allocations NCCL's ALLOC
debug output shows per peer and channel, NVIDIA/nccl#1685). `NCCL_PROTO` drops the protocols it
does not list.

Connections a rank receives on, per channel: a ring's 1 (all-gather, reduce-scatter, broadcast);
a tree's up to 3 more (parent and two children; NCCL runs all-reduce on trees); every other rank
for an all-to-all (sequence parallelism). Channels: at most `NCCL_MAX_NCHANNELS` (32 unless set,
what NCCL opens on an NVSwitch node, NVIDIA/nccl#1685), so the rows are an upper bound. NCCL's
send-side and proxy buffers and its host memory are not counted, nor vLLM's own tensor-parallel
communicator (it exists before vLLM profiles its memory, so it is inside vLLM's share).

Communicators: every learner rank is in the learners' group (ZeRO-3's all-gather and
reduce-scatter, all-reduces of norms and metrics) and in its TP or SP group when it has one;
learner rank 0 is in the weight sync's: one group with every searcher (in-process engines), or
one group per engine with its TP workers (out of process, one feed each: comm/weight_sync/feeds.py);
each engine GPU is in its one weight-sync group.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_tba.config import RunConfig

MiB = 2**20
DEFAULTS = {"NCCL_BUFFSIZE": 4 * MiB, "NCCL_LL_BUFFSIZE": 8 * 512 * 8 * 16,
            "NCCL_LL128_BUFFSIZE": 120 * 640 * 8 * 8, "NCCL_MAX_NCHANNELS": 32}
PROTOCOLS = {"Simple": "NCCL_BUFFSIZE", "LL": "NCCL_LL_BUFFSIZE", "LL128": "NCCL_LL128_BUFFSIZE"}
GRANULE = 2 * MiB
"""NCCL's allocation granularity for connection buffers (cuMem)."""


@dataclasses.dataclass(frozen=True)
class NcclSizes:
    """What one connection on one channel costs, and how many channels a communicator opens."""

    connection_bytes: int
    channels: int

    def communicator(self, connections: int) -> int:
        """Bytes on one rank for a communicator it receives on `connections` times per channel."""
        return self.channels * connections * self.connection_bytes


def nccl_sizes(env: Mapping[str, str]) -> NcclSizes:
    """The sizes from a job's environment (cluster.env), NCCL's defaults where unset."""
    def value(key: str) -> int:
        raw = env.get(key)
        if raw is None:
            return DEFAULTS[key]
        try:
            v = int(str(raw), 0)
        except ValueError:
            raise ValueError(f"cluster.env.{key}={raw!r} is not an integer") from None
        if v < 1:
            raise ValueError(f"cluster.env.{key}={raw!r} must be >= 1")
        return v

    protos = env.get("NCCL_PROTO")
    names = [p.strip() for p in str(protos).split(",") if p.strip()] if protos else list(PROTOCOLS)
    unknown = [p for p in names if p not in PROTOCOLS]
    if unknown:  # NCCL also takes a leading ^ (all but): not parsed here, named instead
        raise ValueError(f"cluster.env.NCCL_PROTO={protos!r}: the planner counts only a list of "
                         f"{', '.join(PROTOCOLS)} (unknown: {', '.join(unknown)})")
    raw = sum(value(PROTOCOLS[p]) for p in names)
    return NcclSizes(-(-raw // GRANULE) * GRANULE, value("NCCL_MAX_NCHANNELS"))


def collective_connections(n: int) -> int:
    """Connections per channel a rank receives on in a group of n ranks running ring collectives
    and tree all-reduces: the ring's one and up to three tree neighbours (none alone)."""
    return 0 if n < 2 else 1 + min(3, n - 1)


def learner_bytes(cfg: RunConfig) -> tuple[int, int, str, str]:
    """(every learner rank's bytes, learner rank 0's weight-sync bytes, and a note for each)."""
    c, lr, s = cfg.cluster, cfg.learner, cfg.searcher
    sz = nccl_sizes(c.env)
    conn = sz.connection_bytes / MiB
    n = c.num_learners
    groups = [(f"learners {n}", collective_connections(n))]
    if lr.tensor_parallel_size > 1:
        groups.append((f"TP {lr.tensor_parallel_size}", collective_connections(lr.tensor_parallel_size)))
    if lr.sequence_parallel_size > 1:  # Ulysses: an all-to-all over the SP group
        groups.append((f"SP {lr.sequence_parallel_size} all-to-all", lr.sequence_parallel_size - 1))
    every = sum(sz.communicator(k) for _, k in groups)
    note = (f"{sz.channels} channels x {conn:g} MiB x connections: "
            + ", ".join(f"{name} ({k})" for name, k in groups))
    if not c.num_searchers:
        return every, 0, note, ""
    count = c.num_searchers if s.engine_process else 1  # a ring broadcast: 1 connection each
    sync = count * sz.communicator(1)
    what = (f"{count} engine groups of 1 + TP {s.tensor_parallel_size}" if s.engine_process
            else f"one group with {c.num_searchers} searchers")
    return every, sync, note, f"{what}: {sz.channels} channels x 1 x {conn:g} MiB each"


def engine_bytes(cfg: RunConfig) -> int:
    """An engine GPU's weight-sync communicator (a ring broadcast: one connection)."""
    return nccl_sizes(cfg.cluster.env).communicator(1) if cfg.cluster.num_searchers else 0
