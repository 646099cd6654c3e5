"""Learner rank 0's feeds: out-of-process engines take versions at their own pace (issue 24).

`WeightSender.send` does not broadcast to engine groups itself: it writes the version into one
of `learner.sync_versions_held` host copies on learner rank 0's node (`HeldVersions`) and
returns. One `Feed` thread per engine group (worker_groups.py) broadcasts from those copies:

- a feed that is idle takes the newest version (even one still being written: it follows the
  writer bucket by bucket, so the learner's copy overlaps the engine's transfer);
- a feed still busy with an older version finishes it, then takes the newest; the versions in
  between are never sent to that engine (listed in its next offer: skipped);
- a copy being read is never rewritten: the learner writes the oldest copy no feed reads, and
  when every copy is being read the version is not held at all (`unheld`; the busy feeds skip
  it). The learner never waits for a feed.

Per version it sends, a feed posts an **offer** on the engine group's store (version, flags and
the versions it skipped since its last offer), waits for the searcher's decision (accept: its
workers load it; skip: the searcher is busy, nothing is broadcast) and, accepted, broadcasts
each bucket as consecutive pieces (`Manifest.piece_numel`). The workers read the decision on the
host before they post a receive. Its transfer time, to completion (every broadcast waited for on
the host), is the engine's `sync/engine_time_s`.

Where a learner's parameters live on a GPU the held copies are pinned host memory (exactly their
bytes) and the feed broadcasts through two device pieces of its own (`device_pieces`), on its own
CUDA stream, waited for on the host (NCCL takes device memory only): the CUDA branch of
`_broadcast`, run by tests/test_gpu.py. On CPU the feed broadcasts the host copy directly.
"""
from __future__ import annotations

import contextlib
import threading
import time

import torch

from hpc_tba.comm.weight_sync.group import broadcast_async, register_host
from hpc_tba.comm.weight_sync.manifest import Manifest

VERSIONS_HELD = 2
"""Default `learner.sync_versions_held`."""


def held_bytes(manifest: Manifest, versions_held: int, room: int = 0) -> int:
    """Host bytes of learner rank 0's held copies (the planner's row): `versions_held` copies of
    the version, each with `room` elements more for the zero padding a direct ZeRO-3 gather
    spills past the last parameter (`WeightSender`)."""
    return versions_held * (manifest.numel + room) * manifest.dtype.itemsize


def device_piece_numel(piece_numel: int, largest_bucket_numel: int) -> int:
    """Elements of each of a feed's two device buffers: one broadcast piece, at most the largest
    bucket (the planner counts with it too)."""
    return min(piece_numel, largest_bucket_numel)


def device_pieces(manifest: Manifest, device) -> list[torch.Tensor]:
    """The two device buffers of one broadcast piece each (`Manifest.piece_numel`, at most the
    largest bucket) a feed allocates when the learner runs on a GPU (the dry run calls it on the
    meta device): pieces, not buckets, because every engine has a feed (16 engines of a 70B run,
    2 GiB buckets: 62 GiB of buckets on learner rank 0's GPU; 8 GiB of pieces)."""
    numel = device_piece_numel(manifest.piece_numel, manifest.largest_bucket_numel)
    return [torch.empty(numel, dtype=manifest.dtype, device=device) for _ in range(2)]


class HeldVersions:
    """Learner rank 0's host copies of recent versions and the log of every version sent.

    The sender (one thread) calls `begin` / `wrote` / `abort`; feeds call `acquire` /
    `wait_written` / `release`. A copy's `seq` is the index in `log` of the version it holds."""

    def __init__(self, manifest: Manifest, count: int, *, room: int = 0, device: str = "cpu",
                 pin: bool = False):
        if count < 1:
            raise ValueError(f"learner.sync_versions_held={count} must be >= 1")
        self.manifest, self.count, self.room = manifest, count, room
        self.device, self.pin = torch.device(device), pin
        self.bufs: list[torch.Tensor | None] = [None] * count
        self.seq, self.written, self.readers = [-1] * count, [0] * count, [0] * count
        self.events: list[list] = [[] for _ in range(count)]  # CUDA: the copy of bucket b done
        self.log: list[tuple[int, int, bool]] = []  # per send: (version, flags, held)
        self.unheld = 0
        self.cond = threading.Condition()
        self.allocated_bytes = 0
        """Bytes of the copies allocated so far (at most `held_bytes`)."""

    def alloc(self, i: int) -> torch.Tensor:
        """Copy i's buffer, allocated at its first use (exactly its bytes; pinned in place on a
        GPU learner, not through torch's power-of-two caching host allocator). Under the lock: the
        sender and a feed that took the copy as soon as it began may both ask for it first."""
        with self.cond:
            if self.bufs[i] is None:
                t = torch.empty(self.manifest.numel + self.room, dtype=self.manifest.dtype,
                                device=self.device)
                if self.pin:  # GPU learners only (tests/test_gpu.py)
                    register_host(t)
                self.bufs[i] = t
                self.allocated_bytes += t.numel() * t.element_size()
            return self.bufs[i]

    # ---------------------------------------------------------------- the sender's side
    def begin(self, version: int, flags: int) -> int | None:
        """Log a version; the copy it is written into (the oldest no feed reads), or None when
        every copy is being read (the version is not held: the busy feeds skip it)."""
        with self.cond:
            free = [i for i in range(self.count) if self.readers[i] == 0]
            held = bool(free)
            self.log.append((version, flags, held))
            if not held:
                self.unheld += 1
                self.cond.notify_all()
                return None
            i = min(free, key=lambda j: self.seq[j])
            self.seq[i], self.written[i], self.events[i] = len(self.log) - 1, 0, []
            self.cond.notify_all()
        self.alloc(i)
        return i

    def region(self, i: int, b: int) -> torch.Tensor:
        """Copy i from bucket b's start to its end (room for a gather's padding included)."""
        return self.alloc(i)[self.manifest.bucket_starts[b]:]

    def wrote(self, i: int, b: int, event=None) -> None:
        """Bucket b of copy i holds its bytes (on a GPU learner: once `event` has completed)."""
        with self.cond:
            self.events[i].append(event)
            self.written[i] = b + 1
            self.cond.notify_all()

    def abort(self, i: int) -> None:
        """The send writing copy i failed: feeds reading it stop."""
        with self.cond:
            self.written[i] = -1
            self.cond.notify_all()

    # ---------------------------------------------------------------- the feeds' side
    def acquire(self, first: int, stop) -> tuple[int, int] | None:
        """(copy, seq) of the newest held version whose seq >= `first`, now read by the caller
        (it may still be being written); blocks until there is one, None once `stop()`."""
        with self.cond:
            while not stop():
                ok = [i for i in range(self.count) if self.seq[i] >= first and self.written[i] >= 0]
                if ok:
                    i = max(ok, key=lambda j: self.seq[j])
                    self.readers[i] += 1
                    return i, self.seq[i]
                self.cond.wait(0.2)
            return None

    def wait_written(self, i: int, b: int) -> None:
        """Block until bucket b of copy i is written (raises if its send failed)."""
        with self.cond:
            while 0 <= self.written[i] <= b:
                self.cond.wait(0.2)
            if self.written[i] < 0:
                raise RuntimeError("the learner's send of this version failed")
            event = self.events[i][b]
        if event is not None:  # GPU learner: the device-to-host copy of bucket b
            event.synchronize()

    def release(self, i: int) -> None:
        with self.cond:
            self.readers[i] -= 1
            self.cond.notify_all()


class Feed:
    """One engine group's feed: a thread that offers its engine the newest held version each time
    it is free, and broadcasts it when the searcher accepts. `on_failure(feed, error)` is called
    once (from the thread) when a broadcast fails: the engine died."""

    def __init__(self, index: int, gen: int, pg, store, held: HeldVersions, *, device: str,
                 on_failure):
        self.index, self.gen, self.pg, self.store, self.held = index, gen, pg, store, held
        self.device, self.on_failure = torch.device(device), on_failure
        with held.cond:
            self.next = len(held.log)  # the first version it considers: the next one sent
        self.times: list[float] = []
        """Seconds of each accepted version's transfer, to completion on the host."""
        self.sent: list[int] = []
        self.skipped = self.declined = 0
        self.error: BaseException | None = None
        self._stop = False
        self._dev: list[torch.Tensor] = []  # CUDA learner: the feed's two device buckets
        self._stream, self._j = None, 0  # and its own CUDA stream, pieces sent through them
        self._thread = threading.Thread(target=self._run, name=f"weight-feed-{index}-{gen}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from hpc_tba.comm.weight_sync.worker_groups import drop_offer, post_offer, wait_decision

        k, stop = 0, lambda: self._stop
        try:
            while True:
                got = self.held.acquire(self.next, stop)
                if got is None:
                    return
                i, seq = got
                try:
                    version, flags, _ = self.held.log[seq]
                    missed = [(v, f) for v, f, _ in self.held.log[self.next: seq]]
                    self.next, self.skipped = seq + 1, self.skipped + len(missed)
                    post_offer(self.store, k, version, flags, missed)
                    decision = wait_decision(self.store, k, stop=stop)  # polls stop() every second
                    if decision is None:
                        return
                    drop_offer(self.store, k)
                    if decision[2]:
                        t0 = time.perf_counter()
                        self._broadcast(i)
                        self.times.append(time.perf_counter() - t0)
                        self.sent.append(version)
                    else:
                        self.declined += 1
                finally:
                    self.held.release(i)
                k += 1
        except BaseException as e:  # noqa: BLE001 - that engine's group is dropped
            self.error = e
            self.on_failure(self, e)

    def _broadcast(self, i: int) -> None:
        """Every bucket of copy i, as it is written, on the engine group, as the manifest's
        pieces; the previous bucket's (GPU: piece's) broadcasts are waited for once the next ones
        are posted, the last ones on the host."""
        m, starts, piece = self.held.manifest, self.held.manifest.bucket_starts, self.held.manifest.piece_numel
        buf = self.held.alloc(i)
        cuda = self.device.type == "cuda"
        if cuda and not self._dev:  # CUDA branch (tests/test_gpu.py): two device pieces
            self._stream = torch.cuda.Stream(self.device)
            self._dev = device_pieces(m, self.device)
        works: list = []
        with torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext():
            for b in range(len(m.buckets)):
                self.held.wait_written(i, b)
                part = buf[starts[b]: starts[b + 1]]
                pieces = [part[s: s + piece] for s in range(0, part.numel(), piece)]
                if cuda:
                    works = self._through_device(pieces, works)
                    continue
                new = [broadcast_async(self.pg, p) for p in pieces]
                for w in works:
                    w.wait()
                works = new
            for w in works:
                w.wait()
        if cuda:
            self._stream.synchronize()  # to completion, on the host

    def _through_device(self, pieces: list[torch.Tensor], works: list) -> list:
        """CUDA learner: each host piece copied into device piece j % 2 and broadcast from there,
        on the feed's stream; waiting for piece j - 1's broadcast (it orders the stream with NCCL)
        makes piece j + 1's copy wait for it. Returns the last piece's Work."""
        for p in pieces:
            j, self._j = self._j, self._j + 1
            dev = self._dev[j % 2][: p.numel()]
            dev.copy_(p, non_blocking=True)
            work = broadcast_async(self.pg, dev)
            for w in works:
                w.wait()
            works = [work]
        return works

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop after the version being broadcast, if any (its workers drain what the searcher
        abandoned)."""
        self._stop = True
        with self.held.cond:
            self.held.cond.notify_all()
        self._thread.join(timeout_s)
