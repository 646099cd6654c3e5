"""The sync group (learner rank 0 + every searcher): a standalone process group from its own
TCPStore, the broadcasts from its rank 0 that carry every bucket, and the host-side headers.

A version is announced on the host before any device receive is posted: its header is a key of
the group's TCPStore (`post_header` / `wait_header`), not a collective, so between two syncs no
receive is pending on the group (with NCCL a posted receive would keep a kernel spinning on the
engine's GPU for the whole interval). Every receive is waited for on the host (`receive`).
"""
from __future__ import annotations

import datetime

import torch

_STORES: dict[int, list] = {}  # id(group) -> [its store, next header number, oldest kept header]
_HEADER_KEY = "hpc_tba/sync_header/{}"
_READ_KEY = "hpc_tba/sync_header_read/{}"
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
    _STORES[id(pg)] = [store, 0, 0]  # the group needs its store for as long as the process lives;
    # [store, next header number, oldest header whose key may still be unread]
    return pg


def attach_store(pg, store) -> None:
    """Give a group built elsewhere its header store (tests wrapping a group)."""
    _STORES[id(pg)] = [store, 0, 0]


def _store_of(pg) -> list:
    entry = _STORES.get(id(pg))
    if entry is None:
        raise ValueError("weight-sync group has no header store: build it with new_group "
                         "(or attach_store)")
    return entry


def post_header(pg, header: list[int]) -> None:
    """Rank 0: announce the next sync (its header ints) on the host. A header's key is dropped
    once every member has read it (each counts itself on the store): a sync's broadcasts
    completing on rank 0 does not mean every member has read its header (gloo's sends complete
    once buffered, so rank 0 can post the next header before a slow member read this one)."""
    entry = _store_of(pg)
    store, seq, oldest = entry
    store.set(_HEADER_KEY.format(seq), ",".join(str(int(x)) for x in header))
    oldest = drop_read_keys(store, oldest, seq, pg.size() - 1, _HEADER_KEY.format, _READ_KEY.format)
    entry[1:] = [seq + 1, oldest]


def drop_read_keys(store, oldest: int, upto: int, readers: int, key, read_key) -> int:
    """Delete the keys `key(i)` for oldest <= i < upto that all `readers` have counted themselves
    on (`read_key(i)`), in order, stopping at the first one still unread; returns the new oldest."""
    while oldest < upto and store.add(read_key(oldest), 0) >= readers:
        store.delete_key(key(oldest))
        store.delete_key(read_key(oldest))
        oldest += 1
    return oldest


def wait_header(pg, *, poll_s: float = 60.0) -> list[int]:
    """Other ranks: block on the host until the next header is posted; returns its ints."""
    entry = _store_of(pg)
    store, seq = entry[:2]
    key = _HEADER_KEY.format(seq)
    while True:
        try:
            store.wait([key], datetime.timedelta(seconds=poll_s))
            break
        except torch.distributed.DistStoreError as e:  # the learner may be checkpointing: wait on
            if "timeout" not in str(e):
                raise
    entry[1] = seq + 1
    header = [int(x) for x in store.get(key).decode().split(",")]
    store.add(_READ_KEY.format(seq), 1)  # read: rank 0 may drop the key
    return header


def broadcast_async(pg, tensor: torch.Tensor):
    """Start a broadcast from group rank 0; returns the Work (wait() before touching `tensor`)."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([tensor], opts)


def broadcast_pieces(pg, tensor: torch.Tensor, piece_numel: int) -> None:
    """Broadcast a bucket from group rank 0 the way it travels (`Manifest.piece_numel`):
    consecutive pieces of at most `piece_numel` elements, all posted at once, waited for until
    they have completed, on the host: on gloo `Work.wait()` already is that; with NCCL it only
    makes the current stream wait, so the stream is synchronized too (the GPU branch, covered by
    tools/gpu_check.sh)."""
    works = [broadcast_async(pg, tensor[s: s + piece_numel])
             for s in range(0, tensor.numel(), piece_numel)]
    for work in works:
        work.wait()
    sync_stream(tensor.device)


def sync_stream(device: str | torch.device) -> None:
    """Block the host until `device`'s current stream has finished (NCCL work is queued there);
    nothing to wait for on CPU. The one device branch of the sync (covered by tools/gpu_check.sh)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


_STOPPED_KEY = "hpc_tba/sync_stopped"


def stop_receivers(pg, *, timeout_s: float = GROUP_TIMEOUT_S) -> None:
    """Rank 0: announce STOP, then wait on the host until every receiver has read it (each counts
    itself on the store: no collective, so a searcher whose engine's workers received every
    version never touches a device), so the store this rank hosts outlives their reads."""
    import time

    from hpc_tba.comm.weight_sync.manifest import FLAG_STOP

    store, seq = _store_of(pg)[:2]
    key = f"{_STOPPED_KEY}/{seq}"  # this STOP's header number: a group may be stopped again
    post_header(pg, [-1, FLAG_STOP, 0])
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < pg.size() - 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"weight sync: {pg.size() - 1 - store.add(key, 0)} receiver(s) did "
                               f"not acknowledge STOP within {timeout_s:.0f} s")
        time.sleep(0.01)


def acknowledge_stop(pg) -> None:
    """A receiver has read STOP, the last header `wait_header` returned (`stop_receivers` waits
    for every receiver's acknowledgement)."""
    store, seq = _store_of(pg)[:2]
    store.add(f"{_STOPPED_KEY}/{seq - 1}", 1)


def register_host(t: torch.Tensor) -> None:
    """Pin `t`'s memory in place (exactly its bytes; not torch's caching host allocator, which rounds
    up to a power of two) and unpin it when it is freed. GPU machines only (tools/gpu_check.sh)."""
    import weakref

    cudart = torch.cuda.cudart()
    nbytes = t.numel() * t.element_size()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host staging failed (error {err})")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
