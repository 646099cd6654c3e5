"""Searcher side of the weight sync: `WeightReceiver`, whose thread receives every version from the
sync group, bucket by bucket, into bounded staging (device, host or stream: staging.py), and whose
methods hand the versions to the searcher. An out-of-process engine whose workers receive
themselves is served through its `EngineOffers` base (engine_offers.py)."""
from __future__ import annotations

import contextlib
import functools
import math
import queue
import threading
import time
import weakref
from collections.abc import Iterator

import torch

from hpc_tba.comm.weight_sync.engine_offers import EngineOffers, WorkerVersion
from hpc_tba.comm.weight_sync.group import acknowledge_stop, broadcast_pieces, register_host, wait_header
from hpc_tba.comm.weight_sync.manifest import FLAG_EVAL, FLAG_STOP, Manifest
from hpc_tba.comm.weight_sync.staging import STAGING_MODES, StagedWeights, StreamedWeights


class WeightReceiver(EngineOffers):
    """Searcher side: a thread receives every version, bucket by bucket, into bounded staging.

    `device` is where broadcasts land (the sync group's device: cuda for NCCL). `staging`:

    - device: one version buffer on `device`, plus one bucket the broadcast lands in.
    - host: the version buffer in host memory (pinned when CUDA exists), plus one bucket on
      `device` (NCCL cannot receive into host memory).
    - stream: no version buffer; `take()` hands out a `StreamedWeights` as soon as a version's
      header arrived and the buckets are received while the engine loads them. At most two
      buckets are allocated at a time (one being loaded, one being received). A version
      announced while the searcher is not `accepting` (a between-rounds round under way) is
      drained into one bucket and skipped, so the learners never wait for a round.

    A version arriving while a load reads the device/host buffer is skipped the same way; every
    skipped (or replaced before taken) version is in `skipped_versions`.

    Memory (`staging_bytes`): device/host = one whole version + one bucket; stream = two buckets
    (the largest bucket of the manifest, in its wire dtype, which is the engine's dtype with
    `learner.sync_wire_dtype=auto`). Only one version is ever staged: a version that arrives
    before the previous one was taken replaces it. A vLLM layer whose parameters straddle more
    than two buckets keeps the earlier ones referenced until it is complete (vLLM's layer-wise
    reload), so stream's bound needs buckets no smaller than one layer. `peak_staging_bytes`
    counts every byte the receiver allocated, measured, not computed.
    """

    def __init__(self, manifest: Manifest, group, *, device: str = "cpu", staging: str = "host",
                 accepting: bool = True):
        if staging not in STAGING_MODES:
            raise ValueError(f"weight staging {staging!r} is not one of {STAGING_MODES} "
                             "(resolve auto with resolve_staging)")
        self.manifest, self.group, self.device, self.staging = manifest, group, device, staging
        self._cond = threading.Condition()
        self._latest: StagedWeights | StreamedWeights | None = None
        self._complete: StagedWeights | None = None  # the whole version in the buffer
        self._readers = 0
        self._version_buf: torch.Tensor | None = None
        self._bucket: torch.Tensor | None = None  # lands NCCL receives for host staging; drains
        self._pending_eval: list[int] = []
        self._stream_live = 0  # stream: bucket buffers alive (at most two, see _consume)
        self._want_bucket = self._overdraft = False
        self._buckets: queue.Queue = queue.Queue()
        self._consumed = threading.Event()
        self._workers = None  # EngineSlot: an out-of-process engine's workers receive (serve_engine)
        self._offer_thread: threading.Thread | None = None  # its feed's offers (`_offers`)
        self._offer_slot = None  # the slot whose offers are decided (None while an engine changes)
        self.accepting = accepting
        """Stream staging: whether a version announced now is loaded (True: the searcher takes it
        at once, between decode steps or while it waits) or skipped (False: the searcher is busy
        with a round whose samples must not mix versions). Set through `open_window` /
        `close_window`; never blocks the learners either way."""
        self.skipped_versions: list[int] = []
        """Versions received but never handed to the engine: drained because the searcher was
        busy (stream), arrived while a load read the buffer, or replaced before they were taken."""
        self.staging_now, self.peak_staging_bytes = 0, 0
        self.received_versions: list[int] = []
        self.stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="weight-receiver", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ receiving thread
    def _loop(self) -> None:
        try:
            while True:
                # announced on the host: no receive is posted on the group between two syncs
                header = wait_header(self.group)
                version, flags, nb = header[:3]
                if flags & FLAG_STOP:
                    acknowledge_stop(self.group)
                    return
                if nb != len(self.manifest.buckets):
                    raise RuntimeError(f"sync header announces {nb} buckets, manifest has "
                                       f"{len(self.manifest.buckets)}")
                # [version, flags, buckets, data on the sync group, engine generation per searcher]
                on_sync = len(header) < 4 or bool(header[3])
                gens = header[4:]
                if self._workers is not None:
                    me = self.group.rank() - 1
                    self._to_workers(version, flags, on_sync,
                                     me < len(gens) and gens[me] == self._workers.gen)
                elif not on_sync:
                    raise RuntimeError("sync header sends no data on the sync group, but this "
                                       "searcher's engine has not joined an engine group")
                elif self.staging == "stream":
                    self._stream(version, flags)
                else:
                    self._stage(version, flags)
        except BaseException as e:  # surfaced to the searcher's main loop by take()
            self.error = e
            with self._cond:
                self._buckets.put(None)  # a consumer waiting for a bucket wakes up and raises
                self._cond.notify_all()
        finally:
            with self._cond:
                self.stopped = True
                self._cond.notify_all()

    def _alloc(self, numel: int, device, *, pin: bool = False, stream: bool = False) -> torch.Tensor:
        """A buffer whose bytes count as staging until the last view of it is gone.

        Exactly `numel` elements: pinned host memory is plain memory registered with CUDA
        (`cudaHostRegister`), not torch's caching host allocator, which rounds every block up to a
        power of two (ATen's CachingHostAllocator: 131 GiB would take 256 GiB). CPU runs have no
        CUDA to pin with; the GPU branch is checked by tools/gpu_check.sh."""
        t = torch.empty(numel, dtype=self.manifest.dtype, device=device)
        nbytes = t.numel() * t.element_size()
        if pin and nbytes:
            register_host(t)
        with self._cond:
            self.staging_now += nbytes
            self._stream_live += stream
            self.peak_staging_bytes = max(self.peak_staging_bytes, self.staging_now)
        weakref.finalize(t, self._freed, nbytes, stream)
        return t

    def _freed(self, nbytes: int, stream: bool) -> None:
        with self._cond:
            self.staging_now -= nbytes
            self._stream_live -= stream
            self._cond.notify_all()

    def _drain(self, version: int, *, skipped: bool = True) -> None:
        """Receive a version nobody here will load into one bucket buffer, and drop it (counted)."""
        m = self.manifest
        if self._bucket is None:
            self._bucket = self._alloc(m.largest_bucket_numel, self.device)
        for b in range(len(m.buckets)):
            broadcast_pieces(self.group, self._bucket[: m.bucket_numel(b)], m.piece_numel)
        if self.staging == "stream" or self._workers is not None:  # freed: the bound is buckets
            self._bucket = None
        if skipped:
            with self._cond:
                self.skipped_versions.append(version)

    def _stage(self, version: int, flags: int) -> None:
        """Device/host staging: each bucket is received straight into the version buffer (through
        one device bucket when host staging meets an NCCL group). A version that arrives while the
        searcher reads the buffer (an engine loading it) is drained and skipped: the learners
        never wait for a load."""
        m, starts = self.manifest, self.manifest.bucket_starts
        with self._cond:
            busy = self._readers > 0
            if not busy:
                if self._latest is not None:  # staged, never taken: replaced
                    self.skipped_versions.append(self._latest.version)
                self._latest = self._complete = None  # the buffer no longer holds a whole version
        if busy:
            self._drain(version)
            return
        if self._version_buf is None:
            host = self.staging == "host"
            where = "cpu" if host else self.device
            self._version_buf = self._alloc(m.numel, where, pin=host and torch.cuda.is_available())
        flat = self._version_buf
        in_place = flat.device.type == torch.device(self.device).type
        for b in range(len(m.buckets)):
            if in_place:
                broadcast_pieces(self.group, flat[starts[b]: starts[b + 1]], m.piece_numel)
                continue
            if self._bucket is None:  # NCCL receives into device memory only
                self._bucket = self._alloc(m.largest_bucket_numel, self.device)
            part = self._bucket[: m.bucket_numel(b)]
            broadcast_pieces(self.group, part, m.piece_numel)
            flat[starts[b]: starts[b + 1]].copy_(part)
        staged = StagedWeights(version, flags, _views(m, flat, 0))
        with self._cond:
            self._latest = self._complete = staged
            self._announce(version, flags)

    def _stream(self, version: int, flags: int) -> None:
        """Stream staging: hand the version out now; receive bucket b once fewer than two buckets
        are alive (freed by whoever held them last: the engine's loader, usually). A version that
        arrives while the searcher is not accepting is drained and skipped."""
        m = self.manifest
        self._consumed.clear()
        with self._cond:
            accept = self.accepting
            if accept:
                self._latest = StreamedWeights(version, flags, functools.partial(self._consume, version))
                self._announce(version, flags)
            elif flags & FLAG_EVAL:
                self._pending_eval.append(version)  # evaluated with the next version loaded
        if not accept:
            self._drain(version)
            return
        for b in range(len(m.buckets)):
            with self._cond:
                self._want_bucket = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._stream_live < 2 or self._overdraft)
                self._want_bucket = self._overdraft = False
            buf = self._alloc(m.bucket_numel(b), self.device, stream=True)
            broadcast_pieces(self.group, buf, m.piece_numel)
            with self._cond:
                self._buckets.put((b, buf))
                self._cond.notify_all()
            del buf  # the consumer (and vLLM's layer-wise reload) holds the only references
        self._consumed.wait()

    def _consume(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The buckets of a streamed version, in order, each as soon as it has arrived.

        If the loader still holds two buckets when it asks for the next one (a vLLM layer whose
        parameters straddle three buckets), one more bucket is allowed: waiting would deadlock.
        """
        m = self.manifest
        try:
            for b in range(len(m.buckets)):
                with self._cond:
                    self._cond.wait_for(lambda: not self._buckets.empty() or self.error is not None
                                        or (self._want_bucket and self._stream_live >= 2))
                    if self._buckets.empty() and self.error is None:
                        self._overdraft = True
                        self._cond.notify_all()
                item = self._buckets.get()
                if item is None:
                    raise RuntimeError(f"weight receiver failed: {self.error}") from self.error
                got, buf = item
                del item
                if got != b:
                    raise RuntimeError(f"weight stream: bucket {got} arrived where {b} was due")
                yield from m.bucket_views(b, buf)
                del buf
        finally:
            self._consumed.set()

    def _announce(self, version: int, flags: int) -> None:
        self.received_versions.append(version)
        if flags & FLAG_EVAL:
            self._pending_eval.append(version)
        self._cond.notify_all()

    # ------------------------------------------------------------ the searcher's side
    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """While inside, staged tensors stay as they are (the receiver waits to overwrite them)."""
        with self._cond:
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    def open_window(self) -> None:
        """Stream staging: versions announced from now on are handed to the searcher."""
        with self._cond:
            self.accepting = True

    def close_window(self) -> bool:
        """Stream staging: versions announced from now on are skipped until `open_window`;
        returns whether one was accepted and not taken yet (load it before going busy)."""
        with self._cond:
            self.accepting = False
            return self._latest is not None

    def ready(self) -> bool:
        """Whether a version not yet taken is staged (or, streaming, announced)."""
        if self.error is not None:
            raise RuntimeError(f"weight receiver failed: {self.error}") from self.error
        return self._latest is not None

    def take(self) -> tuple[StagedWeights | StreamedWeights | None, list[int]]:
        """The newest version not yet taken (or None) and versions awaiting evaluation.

        Staged tensors are valid while the caller is inside `reading()`; a StreamedWeights must
        be iterated (once, to the end) before the receiver can take the next version.
        """
        if self.error is not None:
            raise RuntimeError(f"weight receiver failed: {self.error}") from self.error
        with self._cond:
            latest, self._latest = self._latest, None
            evals, self._pending_eval = self._pending_eval, []
        return latest, evals

    def current(self) -> StagedWeights | None:
        """The whole version in the buffer (taken or not; call inside `reading()`), or None when
        a newer one is half received or the staging is stream (an engine rebuilt then waits for
        the next version)."""
        with self._cond:
            return self._complete

    def drain(self) -> None:
        """Stream staging: consume (and discard) a version nobody will load, so the thread can
        reach the next header (a searcher that stops)."""
        latest, _ = self.take() if self.error is None else (None, [])
        if isinstance(latest, StreamedWeights):
            got = latest.tensors()
            if isinstance(got, WorkerVersion):
                got.abandon()
                return
            for _ in got:
                pass

    def wait_for(self, version: int, timeout: float | None = None) -> bool:
        """Block until a version >= `version` has been received (False on timeout or stop)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.stopped or any(v >= version for v in self.received_versions),
                timeout) and any(v >= version for v in self.received_versions)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (after STOP), draining streamed versions on the way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._thread.is_alive() or (self._offer_thread is not None
                                          and self._offer_thread.is_alive()):
            if self.staging == "stream":
                self.drain()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            thread = self._thread if self._thread.is_alive() else self._offer_thread
            thread.join(0.05 if left is None else min(0.05, left))


def _views(m: Manifest, flat: torch.Tensor, first: int) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of every parameter from index `first` on, laid out from flat[0]."""
    out, off = [], 0
    for name, shape in zip(m.names[first:], m.shapes[first:]):
        n = math.prod(shape)
        out.append((name, flat[off: off + n].view(shape)))
        off += n
    return out
