"""The sync group (learner rank 0 + every searcher): a standalone process group from its own
TCPStore, and the broadcasts from its rank 0 that carry every header and bucket."""
from __future__ import annotations

import datetime

import torch

_STORES: list = []
GROUP_TIMEOUT_S = 1800.0
"""Timeout of every process group the job makes (gloo and NCCL alike)."""


def new_group(*, host: str, port: int, rank: int, size: int, backend: str,
              timeout_s: float = GROUP_TIMEOUT_S) -> torch.distributed.ProcessGroup:
    """A standalone process group of `size` members (rank 0 hosts the store)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=(rank == 0), timeout=timeout)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, size, timeout)
    elif backend == "nccl":  # the same timeout as gloo (NCCL's default is 10 minutes)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        raise ValueError(f"weight-sync backend {backend!r} is not gloo or nccl")
    _STORES.append(store)  # the group needs its store for as long as the process lives
    return pg


def broadcast_async(pg, tensor: torch.Tensor):
    """Start a broadcast from group rank 0; returns the Work (wait() before touching `tensor`)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def broadcast(pg, tensor: torch.Tensor) -> None:
    """Broadcast from group rank 0 and wait for it."""
    broadcast_async(pg, tensor).wait()
