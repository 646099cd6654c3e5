"""Tensors handed to an out-of-process vLLM engine by the searcher's process (`load_weights` of a
list or stream: tests, tools, a rebuilt engine reloading a staged version).

The weight sync itself does not come this way: an out-of-process engine's workers receive the
learner's broadcast themselves (worker_sync.py, comm/weight_sync/worker_groups.py). What is
handed over here by a direct call travels over a small **per-engine** gloo group
(rank 0 = the searcher's process, ranks 1..TP = the workers), built with the engine on a fresh
TCPStore port, so a rebuilt engine gets a fresh group and the learners' sync group is never
touched. The same group and the same host buffers on CPU and GPU: a CUDA worker's loader copies
each host bucket into its shard.

Bounded on both ends, nothing sized by the model: the searcher sends a chunk (at most
`bucket_bytes`, or one tensor larger than that) as soon as its tensors are there, broadcasting
the receiver's own bucket views without a copy when they are host memory (else packing one chunk
into a host buffer); each worker keeps at most two chunk buffers alive (one being loaded by vLLM's
layer-wise reload, one being received), one more only where a layer straddling chunks would
otherwise deadlock. Each chunk on the group: a header [numel, meta bytes] (numel -1: the end),
its names/shapes/dtype as JSON bytes, then its flat data. The workers load inside one
`collective_rpc` through `reload_weights(weights_iterator=...)`, the call the in-process engine
makes.

`WeightHopExtension` is mixed into vLLM's worker class (`worker_extension_cls`); it runs in the
engine's processes, so this module imports only torch and `comm/weight_sync/` (no MPI).
"""
from __future__ import annotations

import concurrent.futures
import datetime
import json
import resource
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch

from hpc_tba.comm.weight_sync import WIRE_DTYPES, broadcast_async, wire_dtype_name
from hpc_tba.engine.worker_sync import CountedBuffers, WorkerSyncMixin

EXTENSION = f"{__name__}.WeightHopExtension"
"""The `worker_extension_cls` an out-of-process engine is built with."""

BUCKET_BYTES = 64 << 20
"""Largest chunk on the hop (a larger tensor travels alone)."""
WORKER_LIVE_CHUNKS = 2
"""Chunk buffers a worker keeps alive at once (one loaded, one received); one more while the
loader still references both (measured: 3 with a loader whose loop variable keeps the last tensor
while it asks for the next)."""
_END = -1


class EngineWeightChannel:
    """The searcher's end of the hop to one engine's workers.

    `rpc(method, **kwargs)` calls a method of every worker and returns their results (vLLM's
    `LLM.collective_rpc`). `num_workers` is the engine's tensor-parallel size. A channel that
    failed mid-transfer is broken for good: the engine must be rebuilt (with a fresh channel).
    `device` is where the engine runs; the hop is the same gloo group of host buffers on both.
    """

    def __init__(self, rpc: Callable[..., list], *, num_workers: int, device: str,
                 bucket_bytes: int = BUCKET_BYTES, timeout_s: float = 600.0):
        if torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError(f"engine weight hop: no transport for device {device!r}")
        self.rpc, self.num_workers = rpc, num_workers
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.group, self._store = None, None
        self.broken: str | None = None
        self.packed_bytes_now = self.peak_packed_bytes = 0
        self._pack_buf: torch.Tensor | None = None  # the one packing buffer of a send
        """Host bytes this process allocated to pack chunks (0 when it forwards bucket views)."""
        self.last_worker_stats: list[dict] = []
        """Per worker, of the last send: elements loaded, peak chunk bytes alive, ru_maxrss growth."""
        self._join_group()

    def _join_group(self) -> None:
        """Rendezvous: this process hosts the store on a fresh port while the workers join."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        size = 1 + self.num_workers
        self._store = dist.TCPStore("127.0.0.1", 0, size, True, timeout, wait_for_workers=False)
        made: dict = {}

        def make() -> None:
            try:
                made["pg"] = dist.ProcessGroupGloo(self._store, 0, size, timeout)
            except BaseException as e:  # surfaced below
                made["error"] = e

        maker = threading.Thread(target=make, name="engine-weight-group", daemon=True)
        maker.start()
        ranks = self.rpc("hpc_tba_join_weight_group", port=self._store.port, size=size,
                         timeout_s=self.timeout_s)
        maker.join()
        if "error" in made:
            raise RuntimeError(f"engine weight group: rendezvous failed: {made['error']}")
        if sorted(ranks) != list(range(1, size)):
            raise RuntimeError(f"engine weight group: workers joined as ranks {ranks}, expected "
                               f"1..{self.num_workers}")
        self.group = made["pg"]

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every worker loads `named_tensors` (Hugging Face names; a list or a stream consumed
        once, chunk by chunk, as it arrives) in place; returns when every worker is done."""
        if self.broken:
            raise RuntimeError(f"engine weight hop is broken ({self.broken}); rebuild the engine")
        it = iter(named_tensors)
        first = [next(it, None)]
        if first[0] is None:
            raise ValueError("engine weight hop: no tensors to load")
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-weight-rpc")
        loading = pool.submit(self.rpc, "hpc_tba_receive_weights")
        loading.add_done_callback(self._watch)
        sent = 0
        try:
            for meta, flat, keep in _chunks(_rest(first, it), self.bucket_bytes, self._packed):
                sent += flat.numel()
                for part in _chunk_message(meta, flat):
                    self._broadcast(part, loading)
                del flat, keep, part  # the source bucket may be freed (and the next one received)
            self._broadcast(torch.tensor([_END, 0], dtype=torch.int64), loading)
            stats = loading.result()
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            self.group.abort()  # the workers' pending receives would otherwise wait out the timeout
            if loading.done() and loading.exception() is not None and e is not loading.exception():
                raise loading.exception() from e  # the workers' error says what went wrong
            raise
        finally:
            self._pack_buf = None
            pool.shutdown(wait=False)
        self.last_worker_stats = stats
        if [s["numel"] for s in stats] != [sent] * self.num_workers:
            raise RuntimeError(f"engine weight hop: workers loaded {[s['numel'] for s in stats]} "
                               f"elements, expected {sent} each")

    def _broadcast(self, tensor: torch.Tensor, loading: concurrent.futures.Future) -> None:
        """Broadcast to the workers and wait (if their load fails, `_watch` aborts the group and
        this wait raises at once instead of waiting out the timeout)."""
        broadcast_async(self.group, tensor).wait()

    def _watch(self, loading: concurrent.futures.Future) -> None:
        if loading.exception() is not None and self.group is not None:
            self.broken = self.broken or f"workers failed: {loading.exception()}"
            self.group.abort()

    def _packed(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for one packed chunk, counted while it lives. One buffer serves every
        chunk of a send: `_chunks` packs the next chunk only once the broadcasts of the one before
        have been waited for, so overwriting it is safe; a fresh buffer per chunk would leave the
        peak to when the backend drops its reference to the last one (after wait() returns)."""
        buf = self._pack_buf
        if buf is not None and buf.dtype == dtype and buf.numel() >= numel:
            return buf[:numel]
        self._pack_buf = buf = None  # released before a larger one is made
        # room for a whole chunk at once (the cap, or a larger tensor): it does not grow again
        itemsize = torch.empty((), dtype=dtype).element_size()
        t = torch.empty(max(numel, self.bucket_bytes // itemsize), dtype=dtype)
        nbytes = t.numel() * t.element_size()
        self.packed_bytes_now += nbytes
        self.peak_packed_bytes = max(self.peak_packed_bytes, self.packed_bytes_now)
        weakref.finalize(t, self._unpacked, nbytes)
        self._pack_buf = t
        return t[:numel]

    def _unpacked(self, nbytes: int) -> None:
        self.packed_bytes_now -= nbytes

    def close(self) -> None:
        """Drop the group (its peers may already be dead: nothing is waited for)."""
        group, self.group, self._store = self.group, None, None
        if group is not None and self.broken:
            group.abort()


def _rest(first: list, it: Iterator) -> Iterator:
    """first[0], then `it`, keeping no reference to first[0] once it is handed on."""
    yield first.pop()
    yield from it


def _chunks(named: Iterable[tuple[str, torch.Tensor]], cap: int,
            packed: Callable[[int, torch.dtype], torch.Tensor]
            ) -> Iterator[tuple[dict, torch.Tensor, list[torch.Tensor]]]:
    """(meta, flat host tensor, its source tensors: keep them until sent) per chunk of at most
    `cap` bytes (or one larger tensor), each yielded as soon as its tensors arrived: adjacent
    host views of one buffer (a staged or streamed bucket) travel as they are, anything else is
    packed into one chunk buffer."""
    run: list[tuple[str, torch.Tensor]] = []
    nbytes = 0
    for name, t in named:
        size = t.numel() * t.element_size()
        if run and (t.dtype != run[0][1].dtype or nbytes + size > cap):
            yield _flush(run, packed)
            nbytes = 0
        run.append((name, t))
        nbytes += size
        # a chunk that fills the cap or ends its source buffer (a bucket of stream staging) goes
        # now: the next bucket is received while this one is forwarded
        if nbytes >= cap or _ends_its_storage(t):
            del t
            yield _flush(run, packed)
            nbytes = 0
            continue
        del t
    if run:
        yield _flush(run, packed)


def _ends_its_storage(t: torch.Tensor) -> bool:
    """Host memory (or the dry run's meta device, plan_dryrun.py) whose buffer ends with `t`."""
    return (t.device.type in ("cpu", "meta") and t.is_contiguous() and
            (t.storage_offset() + t.numel()) * t.element_size() == t.untyped_storage().nbytes())


def _flush(run: list[tuple[str, torch.Tensor]], packed) -> tuple[dict, torch.Tensor, list]:
    tensors = [t for _, t in run]
    meta = {"dtype": wire_dtype_name(tensors[0].dtype),
            "tensors": [[n, list(t.shape)] for n, t in run]}
    flat = _consecutive_views(tensors) if tensors[0].device.type in ("cpu", "meta") else None
    if flat is None:
        flat = packed(sum(t.numel() for t in tensors), tensors[0].dtype)
        off = 0
        for t in tensors:
            flat[off: off + t.numel()].view(t.shape).copy_(t)
            off += t.numel()
    run.clear()  # a flat view shares the storage, not the tensor whose death frees the bucket
    return meta, flat, tensors


def _chunk_message(meta: dict, flat: torch.Tensor) -> list[torch.Tensor]:
    raw = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    return [torch.tensor([flat.numel(), raw.numel()], dtype=torch.int64), raw, flat]


def _consecutive_views(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat tensor that `tensors` tile end to end (same storage, dtype, contiguous), or None."""
    first = tensors[0]
    storage, off = first.untyped_storage(), first.storage_offset()
    for t in tensors:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != off
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        off += t.numel()
    return first.new_empty(0).set_(storage, first.storage_offset(), (off - first.storage_offset(),))


class WeightHopExtension(WorkerSyncMixin):
    """Mixed into vLLM's worker class: the workers' end of `EngineWeightChannel`, and of the
    learner's broadcast itself (`WorkerSyncMixin`, worker_sync.py: the sync path).

    Method names carry an `hpc_tba_` prefix (vLLM refuses an extension whose attributes clash
    with the worker's). `self` is the vLLM worker: `self.rank` is its tensor-parallel rank and
    `self.reload_weights` its in-place loader (CPU and GPU workers alike).
    """

    def hpc_tba_join_weight_group(self, port: int, size: int, timeout_s: float) -> int:
        import torch.distributed as dist

        rank = 1 + self.rank
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout)
        self._hpc_tba_group = (dist.ProcessGroupGloo(store, rank, size, timeout), store)
        return rank

    def hpc_tba_dist_ident(self) -> str | None:
        """vLLM's name for this engine's distributed setup (prefix of its CPU shared memory)."""
        import os

        return os.environ.get("VLLM_DIST_IDENT")

    def hpc_tba_receive_weights(self) -> dict:
        """Receive chunk by chunk and load each in place; returns what was loaded and held:
        {"numel", "peak_bytes" (chunk buffers alive at once), "maxrss_growth_bytes"}."""
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        chunks = _ChunkReceiver(self._hpc_tba_group[0])
        loaded = [0]

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for meta, flat in chunks:
                off = 0
                for name, shape in meta["tensors"]:
                    n = _numel(shape)
                    yield name, flat[off: off + n].view(shape)
                    off += n
                loaded[0] += flat.numel()
                del flat

        try:
            self.reload_weights(weights_iterator=tensors())
            for _ in tensors():  # to the end marker, should the loader have stopped early
                pass
        except BaseException:
            chunks.abandon()  # its receive ends when the searcher aborts the group
            raise
        chunks.close()
        from hpc_tba.models.naming import refresh_tied_heads

        runner = getattr(self, "model_runner", None)  # a vLLM worker has one (test doubles may not)
        if runner is not None:
            refresh_tied_heads(runner.get_model())  # a tied head's CPU copy is stale otherwise
        if chunks.error is not None:
            raise RuntimeError(f"engine weight hop: receiving failed: {chunks.error}") from chunks.error
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        return {"numel": loaded[0], "peak_bytes": chunks.peak_bytes,
                "maxrss_growth_bytes": 1024 * growth}


class _ChunkReceiver(CountedBuffers):
    """The worker's receiving thread: chunks off the per-engine group, at most
    `WORKER_LIVE_CHUNKS` buffers alive (freed when vLLM's loader lets go of their views); one
    more when the loader asks for the next chunk while still holding them all (a layer whose
    tensors straddle chunks: waiting would deadlock)."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self._ready: list = []
        self._blocked = self._overdraft = self.done = self._abandoned = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-weight-receive", daemon=True)
        self._thread.start()

    def _recv(self, t: torch.Tensor) -> torch.Tensor:
        broadcast_async(self.group, t).wait()
        return t

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._blocked = True
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._live < WORKER_LIVE_CHUNKS or self._overdraft
                                        or self._abandoned)
                    self._blocked = self._overdraft = False
                    if self._abandoned:
                        return
                numel, meta_len = (int(x) for x in self._recv(torch.zeros(2, dtype=torch.int64)))
                if numel == _END:
                    break
                meta = json.loads(self._recv(torch.zeros(meta_len, dtype=torch.uint8)).numpy().tobytes())
                buf = self._alloc(numel, WIRE_DTYPES[meta["dtype"]])
                self._recv(buf)
                with self._cond:
                    self._ready.append((meta, buf))
                    self._cond.notify_all()
                del buf
        except BaseException as e:  # surfaced to the loader
            self.error = e
        finally:
            with self._cond:
                self.done = True
                self._cond.notify_all()

    def _alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._count(torch.empty(numel, dtype=dtype))

    def __iter__(self) -> Iterator[tuple[dict, torch.Tensor]]:
        while True:
            with self._cond:
                while not self._ready and not self.done:
                    if self._blocked:  # waiting for a slot while the loader holds every buffer
                        self._overdraft = True
                        self._cond.notify_all()
                    self._cond.wait(0.05)
                if not self._ready:
                    if self.error is not None:
                        raise RuntimeError(f"engine weight hop: receiving failed: {self.error}")
                    return
                item = self._ready.pop(0)
            yield item
            del item

    def close(self) -> None:
        """After the end marker: the thread has finished."""
        self._thread.join()

    def abandon(self) -> None:
        """The loader failed: stop taking chunks (a receive under way ends with the group)."""
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
