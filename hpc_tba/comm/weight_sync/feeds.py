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


def held_bytes(version_bytes: int, versions_held: int, room_bytes: int = 0) -> int:
    """Host bytes of learner rank 0's held copies (the planner's row, and what `HeldVersions`
    allocates): `versions_held` copies of the version, each with `room_bytes` more for the zero
    padding a direct ZeRO-3 gather spills past the last parameter (`WeightSender`)."""
    return versions_held * (version_bytes + room_bytes)


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
    """Learner rank 0's host copies of recent versions and the log of the versions sent.

    The sender (one thread) calls `begin` / `wrote` / `abort` / `reclaim`; feeds call `acquire` /
    `take` / `done` / `release` and register in `feeds`. A copy's `seq` is the position in the
    log of the version it holds.

    **Lent buckets (copy on write).** A bucket that lies in place in host memory (one learner's
    flat partition, `WeightSender._in_place`) is not copied when it is sent: the copy *lends* it,
    the feeds broadcast it from the learner's parameters, and `reclaim`, which the learner calls
    before it next changes them (its optimizer step, a checkpoint load), copies only the lent
    buckets some feed may still read and waits for the broadcasts in flight from them. A feed that
    keeps up with the learner has sent the whole version by then: nothing is copied (measured:
    tools/bench_weight_sync.py). On a GPU learner the in-place buckets are device memory and are
    copied to the (pinned) host copy as before, a DMA that costs no CPU."""

    def __init__(self, manifest: Manifest, count: int, *, room: int = 0, device: str = "cpu",
                 pin: bool = False):
        if count < 1:
            raise ValueError(f"learner.sync_versions_held={count} must be >= 1")
        self.manifest, self.count, self.room = manifest, count, room
        self.device, self.pin = torch.device(device), pin
        self.bufs: list[torch.Tensor | None] = [None] * count
        self.seq, self.written, self.readers = [-1] * count, [0] * count, [0] * count
        self.events: list[list] = [[] for _ in range(count)]  # CUDA: the copy of bucket b done
        self.lent: list[dict[int, torch.Tensor]] = [{} for _ in range(count)]
        """Per copy, its lent buckets: views of the learner's parameters, until `reclaim`."""
        self.partial = [False] * count  # a lent bucket no feed needed was dropped: not acquired again
        self.feeds: set = set()
        """Live feeds: their `next` (log position), `reading` (copy), `done` (buckets sent of
        it) and `borrowed` (broadcasts in flight from lent buckets), all under `cond`."""
        self._log: list[tuple[int, int, bool]] = []  # (version, flags, held) from position `_base` on
        self._base = 0
        self.unheld = 0
        self.reclaimed, self.reclaim_s = 0, 0.0
        """Buckets the last `reclaim` copied, and its seconds (copies and waits)."""
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

    @property
    def logged(self) -> int:
        """Versions logged so far (a new feed considers those sent from now on)."""
        return self._base + len(self._log)

    def _entries(self, start: int, stop: int) -> list[tuple[int, int, bool]]:
        return self._log[start - self._base: stop - self._base]

    # ---------------------------------------------------------------- the sender's side
    def begin(self, version: int, flags: int) -> int | None:
        """Log a version; the copy it is written into (the oldest no feed reads), or None when
        every copy is being read (the version is not held: the busy feeds skip it)."""
        with self.cond:
            free = [i for i in range(self.count) if self.readers[i] == 0]
            held = bool(free)
            self._log.append((version, flags, held))
            self._trim()
            if not held:
                self.unheld += 1
                self.cond.notify_all()
                return None
            i = min(free, key=lambda j: self.seq[j])
            self.seq[i], self.written[i], self.events[i] = self.logged - 1, 0, []
            self.lent[i], self.partial[i] = {}, False
            self.cond.notify_all()
        self.alloc(i)
        return i

    def _trim(self) -> None:
        """Forget log entries no feed will read (one per sync otherwise, for the whole run)."""
        keep = min([f.next for f in self.feeds] + [self.logged - 1])
        if keep > self._base:
            del self._log[: keep - self._base]
            self._base = keep

    def region(self, i: int, b: int) -> torch.Tensor:
        """Copy i from bucket b's start to its end (room for a gather's padding included)."""
        return self.alloc(i)[self.manifest.bucket_starts[b]:]

    def wrote(self, i: int, b: int, event=None, *, lent: torch.Tensor | None = None) -> None:
        """Bucket b of copy i holds its bytes (on a GPU learner: once `event` has completed), or
        is `lent`: read where it lies until `reclaim`."""
        with self.cond:
            self.events[i].append(event)
            if lent is not None:
                self.lent[i][b] = lent
            self.written[i] = b + 1
            self.cond.notify_all()

    def abort(self, i: int) -> None:
        """The send writing copy i failed: feeds reading it stop."""
        with self.cond:
            self.written[i] = -1
            self.cond.notify_all()

    def reclaim(self) -> int:
        """Before the learner changes its parameters: copy every lent bucket a feed may still read
        into its held copy, forget the others, and wait for the broadcasts in flight from lent
        buckets (at most two buckets a feed). Returns the buckets copied."""
        t0 = time.perf_counter()
        todo = []
        with self.cond:
            for i in range(self.count):
                for b in list(self.lent[i]):
                    if any(self._needs(f, i, b) for f in self.feeds):
                        todo.append((i, b, self.lent[i][b]))
                    else:
                        del self.lent[i][b]
                        self.partial[i] = True
        starts = self.manifest.bucket_starts
        for i, b, view in todo:  # reading it beside a feed's broadcast of it is fine
            self.alloc(i)[starts[b]: starts[b] + view.numel()].copy_(view)
            with self.cond:
                del self.lent[i][b]  # the feeds read the copy from here on
        with self.cond:
            while any(f.borrowed for f in self.feeds):
                self.cond.wait(0.2)
        self.reclaimed, self.reclaim_s = len(todo), time.perf_counter() - t0
        return len(todo)

    def _needs(self, feed, i: int, b: int) -> bool:
        """Whether `feed` may still read bucket b of copy i (under the lock)."""
        if feed.reading == i:
            return feed.done <= b
        return feed.next <= self.seq[i]

    # ---------------------------------------------------------------- the feeds' side
    def acquire(self, feed, stop) -> tuple[int, int, int, list] | None:
        """(copy, version, flags, skipped [(version, flags)]) of the newest held version at or
        after `feed.next`, now read by `feed` (it may still be being written); blocks until there
        is one, None once `stop()`."""
        with self.cond:
            while not stop():
                ok = [i for i in range(self.count)
                      if self.seq[i] >= feed.next and self.written[i] >= 0 and not self.partial[i]]
                if ok:
                    i = max(ok, key=lambda j: self.seq[j])
                    version, flags, _ = self._entries(self.seq[i], self.seq[i] + 1)[0]
                    missed = [(v, f) for v, f, _ in self._entries(feed.next, self.seq[i])]
                    self.readers[i] += 1
                    feed.reading, feed.done, feed.next = i, 0, self.seq[i] + 1
                    return i, version, flags, missed
                self.cond.wait(0.2)
            return None

    def take(self, feed, i: int, b: int) -> torch.Tensor:
        """Bucket b of copy i once it is written (raises if its send failed): a slice of the copy,
        or the lent parameters themselves (counted in `feed.borrowed` until `done`)."""
        with self.cond:
            while 0 <= self.written[i] <= b:
                self.cond.wait(0.2)
            if self.written[i] < 0:
                raise RuntimeError("the learner's send of this version failed")
            event, part = self.events[i][b], self.lent[i].get(b)
            if part is not None:
                feed.borrowed += 1
        if event is not None:  # GPU learner: the device-to-host copy of bucket b
            event.synchronize()
        if part is None:
            starts = self.manifest.bucket_starts
            part = self.alloc(i)[starts[b]: starts[b + 1]]
        return part

    def done(self, feed, buckets: int, returned: int) -> None:
        """`feed`'s broadcasts of its copy's first `buckets` buckets have completed, `returned` of
        them from lent buckets."""
        with self.cond:
            feed.done, feed.borrowed = buckets, feed.borrowed - returned
            self.cond.notify_all()

    def release(self, feed, i: int) -> None:
        with self.cond:
            self.readers[i] -= 1
            feed.reading = None
            self.cond.notify_all()

    def join(self, feed) -> None:
        """Register a new feed: it considers the versions sent from now on."""
        with self.cond:
            feed.next, feed.reading, feed.done, feed.borrowed = self.logged, None, 0, 0
            self.feeds.add(feed)

    def leave(self, feed) -> None:
        with self.cond:
            self.feeds.discard(feed)
            self.cond.notify_all()


class Feed:
    """One engine group's feed: a thread that offers its engine the newest held version each time
    it is free, and broadcasts it when the searcher accepts. `on_failure(feed, error)` is called
    once (from the thread) when a broadcast fails: the engine died."""

    def __init__(self, index: int, gen: int, pg, store, held: HeldVersions, *, device: str,
                 on_failure):
        self.index, self.gen, self.pg, self.store, self.held = index, gen, pg, store, held
        self.device, self.on_failure = torch.device(device), on_failure
        held.join(self)  # sets next (the next version sent), reading, done, borrowed: its lock's
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
                got = self.held.acquire(self, stop)
                if got is None:
                    return
                i, version, flags, missed = got
                try:
                    self.skipped += len(missed)
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
                    self.held.release(self, i)
                k += 1
        except BaseException as e:  # noqa: BLE001 - that engine's group is dropped
            self.error = e
            self.on_failure(self, e)
        finally:
            self.held.leave(self)

    def _broadcast(self, i: int) -> None:
        """Every bucket of copy i, as it is written, on the engine group, as the manifest's
        pieces; the previous bucket's (GPU: piece's) broadcasts are waited for once the next ones
        are posted, the last ones on the host. Progress (`held.done`) is told on the host: per
        bucket on CPU, at the end on a GPU (where a wait only orders the stream)."""
        m, piece = self.held.manifest, self.held.manifest.piece_numel
        cuda = self.device.type == "cuda"
        if cuda and not self._dev:  # CUDA branch (tests/test_gpu.py): two device pieces
            self._stream = torch.cuda.Stream(self.device)
            self._dev = device_pieces(m, self.device)
        works: list = []
        lent = 0  # broadcasts in flight from lent buckets (CPU: the last bucket's; GPU: all)
        with torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext():
            for b in range(len(m.buckets)):
                before = self.borrowed
                part = self.held.take(self, i, b)
                now = self.borrowed - before  # 1: part is the learner's parameters
                pieces = [part[s: s + piece] for s in range(0, part.numel(), piece)]
                if cuda:
                    works, lent = self._through_device(pieces, works), lent + now
                    continue
                new = [broadcast_async(self.pg, p) for p in pieces]
                for w in works:
                    w.wait()
                if b:
                    self.held.done(self, b, lent)
                works, lent = new, now
            try:
                for w in works:
                    w.wait()
            finally:
                if cuda:
                    self._stream.synchronize()  # to completion, on the host
                self.held.done(self, len(m.buckets), lent)

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

    def request_stop(self) -> None:
        """Ask the thread to end after the version being broadcast, if any (its workers drain
        what the searcher abandoned); a feed waiting for a version wakes at once."""
        self._stop = True
        with self.held.cond:
            self.held.cond.notify_all()

    def stop(self, timeout_s: float = 60.0) -> None:
        """`request_stop`, then wait for the thread."""
        self.request_stop()
        self._thread.join(timeout_s)
