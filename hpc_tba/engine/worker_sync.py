"""An out-of-process engine's workers in the learner's weight broadcast (issue 24).

Each vLLM worker of an out-of-process engine (tensor parallelism, `searcher.engine_process`)
joins its engine's group with learner rank 0 (`comm/weight_sync/worker_groups.py`: built on the
sync group's store, gloo on CPU, NCCL on GPU: the same code) and receives every bucket of the
versions the learner sends straight into its own process, on a thread: at most
`WORKER_LIVE_BUCKETS` bucket buffers alive (one being loaded, one being received; one more when
vLLM's layer-wise reload still holds both when it asks for the next: waiting would deadlock),
each loaded into the worker's shard by `reload_weights(weights_iterator=...)` as soon as it
arrived. The learner's feed for this engine (comm/weight_sync/feeds.py) offers versions at the
engine's pace; the searcher's process only decides, on the host, whether an offered version is
loaded or not sent (the searcher is busy) and asks the workers to load it (`load_version`): it
holds no weights and, on GPU, opens no CUDA context on the engine's GPUs.

On GPU each receive runs on the worker's own CUDA stream and is waited for on the host (the
stream is synchronized) before the loader sees the bucket; the loader's stream is recorded on
the buffer so the allocator does not hand it to the next receive while a copy still reads it
(tools/gpu_check.sh covers that branch).

`WorkerSyncMixin` is part of the worker extension (`worker_ext.WeightHopExtension`); this module
imports only torch and `comm/weight_sync/` (it runs in the engine's processes, no MPI).
"""
from __future__ import annotations

import queue
import resource
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

from hpc_tba.comm.weight_sync import Manifest
from hpc_tba.comm.weight_sync.group import broadcast_pieces
from hpc_tba.comm.weight_sync.worker_groups import abandoned, build_group, join_store, wait_decision

WORKER_LIVE_BUCKETS = 2
"""Bucket buffers a worker keeps alive at once; one more while the loader still holds both."""
_END = object()


def worker_sync_bytes(manifest: Manifest, layer_bytes: int, *, host: bool) -> int:
    """The most a worker's receiving thread allocates at once (the planner's `sync_worker` row):
    WORKER_LIVE_BUCKETS buffers of the largest bucket and one more while the loader holds them
    all, or, while vLLM's layer-wise reload keeps a whole layer (`layer_bytes`) of tensors
    referenced until its last one arrives, that layer and the bucket being received. `host`: the
    worker receives into host memory (CPU), where the first WORKER_LIVE_BUCKETS buffers are
    pooled at the largest bucket's size (`_VersionReceiver._alloc`): in the layer-wise regime
    they may be up to that much larger than the layer's own tensors, so it is counted."""
    bucket = manifest.largest_bucket_numel * manifest.dtype.itemsize
    pooled = WORKER_LIVE_BUCKETS * bucket if host else 0
    return max((WORKER_LIVE_BUCKETS + 1) * bucket, layer_bytes + bucket + pooled)


def is_worker_version(tensors) -> bool:
    """Whether `load_weights` was handed a version the workers receive themselves."""
    from hpc_tba.comm.weight_sync import WorkerVersion

    return isinstance(tensors, WorkerVersion)


def join_workers(rpc: Callable[..., list], slot, manifest: Manifest, names: dict[str, str], *,
                 in_process: bool = False) -> None:
    """Searcher side: every worker of the engine joins `slot`'s group (in the background: the
    learner builds its end at its next sync). `names`: learner name -> the name vLLM loads."""
    if in_process:
        raise ValueError("an in-process engine takes its weights from the searcher's receiver")
    ranks = rpc("hpc_tba_join_sync", **slot.join_args(), manifest=manifest.to_json(),
                names=dict(names))
    if sorted(ranks) != list(range(1, slot.tp + 1)):
        raise RuntimeError(f"engine weight group: workers joined as ranks {ranks}, expected "
                           f"1..{slot.tp}")


def load_version(rpc: Callable[..., list], version) -> list[dict]:
    """Searcher side: every worker loads `version` (a receiver's WorkerVersion) as its buckets
    arrive from the learner; returns each worker's stats (numel, peak_bytes, new_bytes, maxrss
    growth)."""
    try:
        stats = rpc("hpc_tba_load_version", version=version.version)
    finally:
        version.done()
    if not stats or any(s["numel"] != stats[0]["numel"] or s["numel"] <= 0 for s in stats):
        raise RuntimeError(f"engine weight sync: workers loaded {[s['numel'] for s in stats]} "
                           "elements, not the same number")
    return stats


class WorkerSyncMixin:
    """The worker's end: `self.rank` is its tensor-parallel rank, `self.reload_weights` its
    in-place loader (vLLM's CPU and GPU workers alike; `self.device` where it runs)."""

    def hpc_tba_join_sync(self, host: str, port: int, prefix: str, size: int, backend: str,
                          manifest: dict, names: dict) -> int:
        old = getattr(self, "_hpc_tba_sync", None)
        if old is not None:
            old.stop()
        device = torch.device("cpu") if backend == "gloo" else torch.device(self.device)
        self._hpc_tba_sync = _VersionReceiver(host, port, prefix, 1 + self.rank, size, backend,
                                              Manifest.from_json(manifest), names, device)
        return 1 + self.rank

    def hpc_tba_load_version(self, version: int) -> dict:
        """Load `version` bucket by bucket as it arrives; returns what was loaded and held."""
        rx = self._hpc_tba_sync
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        loaded = [0]
        tensors = rx.tensors(version, loaded)
        self.reload_weights(weights_iterator=tensors)
        for _ in tensors:  # to the end of the version, should the loader have stopped early
            pass
        from hpc_tba.models.naming import refresh_tied_heads

        runner = getattr(self, "model_runner", None)  # a vLLM worker has one (test doubles may not)
        if runner is not None:
            refresh_tied_heads(runner.get_model())  # a tied head's CPU copy is stale otherwise
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        return {"numel": loaded[0], "peak_bytes": rx.version_peak_bytes,
                "new_bytes": rx.version_new_bytes,  # buffers allocated (CPU: not from the pool)
                "maxrss_growth_bytes": 1024 * growth}

    def hpc_tba_leave_sync(self) -> None:
        rx, self._hpc_tba_sync = getattr(self, "_hpc_tba_sync", None), None
        if rx is not None:
            rx.stop()


class CountedBuffers:
    """Receive buffers counted while they are alive: `_count` registers one (freed when the last
    view of it goes, e.g. when vLLM's loader lets go), `_live` buffers of `live_bytes` are alive,
    `peak_bytes` is the most at once; `_cond` is notified at every free."""

    def __init__(self):
        self._cond = threading.Condition()
        self._live = 0
        self.live_bytes = self.peak_bytes = 0

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        with self._cond:
            self._live += 1
            self._hold(nbytes)
        weakref.finalize(t, self._freed, nbytes)
        return t

    def _hold(self, nbytes: int) -> None:
        """Under `_cond`: `nbytes` more are held (a new buffer's memory)."""
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._counted()

    def _counted(self) -> None:
        """Called under `_cond` after each new buffer is counted (a subclass's own peaks)."""

    def _freed(self, nbytes: int) -> None:
        with self._cond:
            self._live -= 1
            self.live_bytes -= nbytes
            self._cond.notify_all()


class _VersionReceiver(CountedBuffers):
    """A worker's receiving thread: joins the engine group, then for every decision the searcher
    posts on an offer of the learner's feed, receives that version's buckets (accepted: handed to
    the loader, at most WORKER_LIVE_BUCKETS alive; abandoned: the rest drained into one buffer);
    a version declined is not sent."""

    def __init__(self, host, port, prefix, rank, size, backend, manifest: Manifest,
                 names: dict, device: torch.device):
        self.manifest, self.names, self.device = manifest, names, device
        self.store, self._base_store = join_store(host, port, prefix)
        super().__init__()
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._pool: list[torch.Tensor] = []  # CPU: freed bucket buffers, reused (`_alloc`)
        self._blocked = self._overdraft = self._stopped = False
        self.version_peak_bytes = self.version_new_bytes = 0  # of the version being received
        self.error: BaseException | None = None
        self.group = None
        self._args = (rank, size, backend)
        self._thread = threading.Thread(target=self._run, name="engine-weight-sync", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the receiving thread
    def _run(self) -> None:
        try:
            self.group = build_group(self.store, *self._args)  # once the learner builds its end
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            k = 0
            while True:
                got = wait_decision(self.store, k, stop=lambda: self._stopped)
                if got is None:
                    return
                version, _, accept = got
                if stream is not None:
                    with torch.cuda.stream(stream):
                        self._version(version, k, accept)
                else:
                    self._version(version, k, accept)
                k += 1
        except BaseException as e:  # noqa: BLE001 - surfaced to the loader
            self.error = e
            self._ready.put(None)

    def _recv(self, t: torch.Tensor) -> None:
        broadcast_pieces(self.group, t, self.manifest.piece_numel)

    def _version(self, version: int, k: int, accept: bool) -> None:
        """Receive offer k, `version`, if the searcher accepted it (else the feed sends nothing):
        bucket by bucket to the loader, or, once abandoned, the rest drained into one buffer."""
        if not accept:
            return
        m = self.manifest
        scratch = None
        with self._cond:
            self.version_peak_bytes, self.version_new_bytes = self.live_bytes, 0
        for b in range(len(m.buckets)):
            if accept and self._wait_for_room(k):
                buf = self._alloc(m.bucket_numel(b))
                self._recv(buf)
                self._ready.put((version, b, buf))
                del buf
                continue
            if accept:  # abandoned: nobody will load the rest; what was queued is dropped
                accept = False
                while True:
                    try:
                        self._ready.get_nowait()
                    except queue.Empty:
                        break
            if scratch is None:
                scratch = self._alloc(m.largest_bucket_numel)
            self._recv(scratch[: m.bucket_numel(b)])
        if accept:
            self._ready.put((version, len(m.buckets), None))

    def _wait_for_room(self, k: int) -> bool:
        """Wait until fewer than WORKER_LIVE_BUCKETS buffers are alive (or the loader holds them
        all and asks for more); False if the searcher abandoned version k meanwhile."""
        with self._cond:
            self._blocked = True
            self._cond.notify_all()
            while not (self._live < WORKER_LIVE_BUCKETS or self._overdraft):
                self._cond.wait(0.05)
                if self._live >= WORKER_LIVE_BUCKETS and not self._overdraft and abandoned(self.store, k):
                    self._blocked = False
                    return False
            self._blocked = self._overdraft = False
        return True

    def _alloc(self, numel: int) -> torch.Tensor:
        """A [numel] receive buffer. On CPU, while fewer than WORKER_LIVE_BUCKETS are alive (the
        pipeline: one loaded, one received), it reuses the memory of one freed before: up to
        WORKER_LIVE_BUCKETS buffers of the largest bucket are kept (counted as held while pooled,
        between syncs too); the ones more that a loader holding its buffers asks for are exact
        and not kept (vLLM's layer-wise reload: a whole layer then, as before). A fresh
        `torch.empty` of more than 32 MiB (glibc's largest mmap threshold) is a fresh mmap,
        faulted in and zeroed page by page by the receive: measured with 61 MiB buckets (the
        configs use 64-512 MiB), sync 3.2 s against 1.3 s for the same broadcasts into
        preallocated buffers. On GPU the caching allocator already reuses blocks, and honours the
        loader stream's `record_stream`, which a pool here would bypass: there each bucket is
        `torch.empty`, as before (tools/gpu_check.sh)."""
        m = self.manifest
        if self.device.type != "cpu":
            self.version_new_bytes += numel * m.dtype.itemsize
            return self._count(torch.empty(numel, dtype=m.dtype, device=self.device))
        with self._cond:
            pooled = self._live < WORKER_LIVE_BUCKETS
            base = self._pool.pop() if pooled and self._pool else None
        if base is None:
            base = torch.empty(m.largest_bucket_numel if pooled else numel, dtype=m.dtype)
            nbytes = base.numel() * base.element_size()
            with self._cond:
                self.version_new_bytes += nbytes
                self._hold(nbytes)
        # a tensor of its own on the pooled storage: the loader's views keep it (not `base`) alive
        t = torch.empty(0, dtype=m.dtype).set_(base.untyped_storage(), 0, (numel,))
        with self._cond:
            self._live += 1
        weakref.finalize(t, self._returned, base, pooled)
        return t

    def _returned(self, base: torch.Tensor, pooled: bool) -> None:
        """The last view of a CPU buffer is gone: back to the pool, or dropped."""
        with self._cond:
            self._live -= 1
            if pooled and len(self._pool) < WORKER_LIVE_BUCKETS:
                self._pool.append(base)
            else:
                self.live_bytes -= base.numel() * base.element_size()
            self._cond.notify_all()

    def _counted(self) -> None:
        self.version_peak_bytes = max(self.version_peak_bytes, self.live_bytes)

    # ---------------------------------------------------------------- the loader's side
    def _next(self, version: int):
        while True:
            try:
                item = self._ready.get(timeout=0.05)
            except queue.Empty:
                if self.error is not None:
                    raise RuntimeError(f"engine weight sync: receiving failed: {self.error}") from self.error
                with self._cond:  # the thread waits for room while the loader holds all (and
                    # did not just put the next bucket: it puts before it waits, so an empty queue
                    # read under the lock means it is truly stuck)
                    if self._blocked and self._ready.empty():
                        self._overdraft = True
                        self._cond.notify_all()
                continue
            if item is None:
                raise RuntimeError(f"engine weight sync: receiving failed: {self.error}") from self.error
            if item[0] < version:  # an abandoned version's leftovers
                continue
            if item[0] != version:
                raise RuntimeError(f"engine weight sync: version {item[0]} arrived where "
                                   f"{version} was due")
            return item

    def tensors(self, version: int, loaded: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
        """(vLLM name, view) of every parameter of `version`, bucket by bucket as they arrive."""
        m, names = self.manifest, self.names
        for b in range(len(m.buckets)):
            _, got, buf = self._next(version)
            if got != b:
                raise RuntimeError(f"engine weight sync: bucket {got} arrived where {b} was due")
            if buf.device.type == "cuda":  # the loader's copies read it on their own stream
                buf.record_stream(torch.cuda.current_stream(buf.device))
            for name, view in m.bucket_views(b, buf):
                yield names.get(name, name), view
            loaded[0] += buf.numel()
            del buf, view
        self._next(version)  # the end marker

    def stop(self, timeout_s: float = 10.0) -> None:
        """Leave: the thread ends at its next poll for a decision (within a second) and the
        group goes with it (a process that exits with the thread inside a store wait aborts)."""
        self._stopped = True
        self._thread.join(timeout_s)
        self.group = None
