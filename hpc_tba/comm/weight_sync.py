"""Weight sync: learner rank 0 broadcasts the policy to every searcher, a bucket at a time.

The sync group is its own process group (learner rank 0 + all searchers) built from a TCPStore,
independent of the learners' default group that DeepSpeed uses, so ZeRO-3 collectives and weight
broadcasts never share a communicator. Backend `gloo` on CPU and `nccl` on GPU: same code.

Protocol, per sync: a header int64 [version, flags, num_buckets], then one flat buffer per
bucket in manifest order, in the manifest's wire dtype (fp32 by default, bf16 for large models on
GPU: half the bytes, and what the engine runs in anyway). The manifest (parameter names and shapes
in a fixed order, split into buckets of at most `bucket_bytes` on the wire, and the wire dtype) is
agreed once at setup, so no per-parameter message is ever sent and both sides size every buffer
the same way.

Sender: the ZeRO-3 gather of bucket i+1 overlaps the broadcast of bucket i. Two flat staging
slots alternate; a slot is refilled only once the broadcast that last read it has completed.
Learner ranks other than 0 join only the gathers.

Receiver: a background thread receives bucket by bucket into bounded staging
(`searcher.staging`), so a broadcast completes while the engine is generating. At most one
version is staged per searcher, in the wire dtype (the engine's dtype by default):

    device, host:  sync memory = one whole version + one bucket   (manifest.total_bytes + B)
    stream:        sync memory = two buckets                      (2 B)

where B is the manifest's largest bucket in bytes (at most `learner.sync_bucket_mb`, or one
parameter larger than that). `staging_bytes(manifest, staging)` is that formula, which the
planner counts; `WeightReceiver.peak_staging_bytes` is the measured peak. Device staging keeps
the version on the engine's device, host staging in (pinned, when CUDA exists) host memory, and
stream loads each bucket into the engine as it arrives (WeightReceiver's docstring).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch

FLAG_EVAL = 1
"""The searchers should evaluate this version on the held-out split."""
FLAG_STOP = 2
"""No more versions: receivers exit."""

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Dtypes weights may travel in, by the name the manifest's JSON carries."""
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def wire_dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical manifest name of a wire dtype (accepts torch dtypes, `bf16`, `bfloat16`, ...)."""
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in WIRE_DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"weight-sync wire dtype {dtype} is not one of {list(WIRE_DTYPES)}")
        return names[dtype]
    name = _ALIASES.get(dtype, dtype)
    if name not in WIRE_DTYPES:
        raise ValueError(f"weight-sync wire dtype {dtype!r} is not one of {list(WIRE_DTYPES)}")
    return name


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Parameter names and shapes in broadcast order, grouped into buckets, and the wire dtype."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    buckets: tuple[tuple[int, ...], ...]  # indices into names, in order
    wire_dtype: str = "float32"
    """Name (a key of WIRE_DTYPES) of the dtype every bucket travels in."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire_dtype", wire_dtype_name(self.wire_dtype))
        order = [i for b in self.buckets for i in b]
        if order != list(range(len(self.names))) or len(self.shapes) != len(self.names):
            raise ValueError("weight manifest buckets must cover every parameter once, in order")

    @classmethod
    def build(cls, named_shapes: list[tuple[str, tuple[int, ...]]], *, bucket_bytes: int,
              wire_dtype: torch.dtype | str = torch.float32) -> Manifest:
        """Greedy bucketing: a bucket closes before the parameter that would overflow it (a
        parameter larger than `bucket_bytes` gets a bucket of its own)."""
        itemsize = torch.empty((), dtype=WIRE_DTYPES[wire_dtype_name(wire_dtype)]).element_size()
        buckets, current, size = [], [], 0
        for i, (_, shape) in enumerate(named_shapes):
            nbytes = math.prod(shape) * itemsize
            if current and size + nbytes > bucket_bytes:
                buckets.append(tuple(current))
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(tuple(current))
        return cls(tuple(n for n, _ in named_shapes), tuple(tuple(s) for _, s in named_shapes),
                   tuple(buckets), wire_dtype_name(wire_dtype))

    def to_json(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "buckets": [list(b) for b in self.buckets], "wire_dtype": self.wire_dtype}

    @classmethod
    def from_json(cls, d: dict) -> Manifest:
        return cls(tuple(d["names"]), tuple(tuple(s) for s in d["shapes"]),
                   tuple(tuple(b) for b in d["buckets"]), d.get("wire_dtype", "float32"))

    @property
    def dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.wire_dtype]

    def bucket_numel(self, b: int) -> int:
        return sum(math.prod(self.shapes[i]) for i in self.buckets[b])

    @functools.cached_property
    def bucket_starts(self) -> tuple[int, ...]:
        """Element offset of each bucket in the concatenation of all buckets (and the total)."""
        starts = [0]
        for b in range(len(self.buckets)):
            starts.append(starts[-1] + self.bucket_numel(b))
        return tuple(starts)

    @property
    def numel(self) -> int:
        return self.bucket_starts[-1]

    @property
    def total_bytes(self) -> int:
        """Bytes of one sync on the wire (header excluded)."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


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


def _bcast(pg, tensor: torch.Tensor) -> None:
    broadcast_async(pg, tensor).wait()


class WeightSender:
    """Learner side. Every learner rank calls `send`; only rank 0 has a group and broadcasts.

    Gathering: parameters partitioned by ZeRO-3 (`deepspeed.zero.Init`) are all-gathered straight
    from their shards (`ds_tensor`, the authoritative copy ZeRO-3's optimizer writes) into the
    flat staging slot, in the layout ZeRO-3 partitions them (the flattened parameter cut into
    world-size equal pieces, zero-padded at the end). That is the collective GatheredParameters
    runs, minus the fresh full-size allocation per parameter (page faults on every sync on CPU)
    and minus the second copy into the flat buffer. Anything else (plain parameters, ZeRO++
    secondary partitions, quantized or offloaded shards, `direct_gather=False`) goes through
    `deepspeed.zero.GatheredParameters` and a pack.
    """

    def __init__(self, module: torch.nn.Module, manifest: Manifest, group, *, device: str = "cpu",
                 direct_gather: bool = True):
        params = dict(module.named_parameters())
        missing = [n for n in manifest.names if n not in params]
        if missing:
            raise ValueError(f"weight manifest names parameters the model lacks: {missing[:3]}")
        self.params = [params[n] for n in manifest.names]
        self.manifest = manifest
        self.group = group
        self.device = torch.device(device)
        self.direct = direct_gather and all(_shard_gatherable(p, self.device) for p in self.params)
        self._slots: list[torch.Tensor] = []  # two flat staging buffers, kept across syncs
        self._works: list = [None, None]  # the broadcast that last read each slot
        self._scratch: torch.Tensor | None = None  # gathers whose dtype differs from the wire's
        self.last_timing: dict[str, float] = {}
        """Seconds of the last `send` spent gathering+packing, and blocked on broadcasts."""

    def send(self, version: int, *, flags: int = 0) -> int:
        """Gather and broadcast every bucket; returns bytes broadcast (0 on ranks other than 0).

        Every learner rank joins the gathers (collectives on the learners' group) while rank 0's
        broadcast of the previous bucket is in flight on the sync group. Returns once every
        broadcast of this version has completed on this rank.
        """
        m, root = self.manifest, self.group is not None
        # on the group's device: NCCL moves only CUDA tensors
        header = torch.tensor([version, flags, len(m.buckets)], dtype=torch.int64, device=self.device)
        header_work = broadcast_async(self.group, header) if root else None
        sent, t_gather, t_wait = 0, 0.0, 0.0
        for b, idx in enumerate(m.buckets):
            t0 = time.perf_counter()
            # other learner ranks need a slot only as the all-gather's output
            flat = self._free_slot(b % 2, m.bucket_numel(b)) if root or self.direct else None
            t1 = time.perf_counter()
            self._gather([self.params[i] for i in idx], b % 2, flat, pack=root)
            t_wait, t_gather = t_wait + t1 - t0, t_gather + time.perf_counter() - t1
            if root:
                self._works[b % 2] = broadcast_async(self.group, flat)
                sent += flat.numel() * flat.element_size()
        t0 = time.perf_counter()
        if root:
            header_work.wait()
            for slot in range(len(self._works)):
                self._free_slot(slot, 0)
        self.last_timing = {"gather_pack_s": t_gather, "wait_s": t_wait + time.perf_counter() - t0}
        return sent

    def _gather(self, params: list[torch.nn.Parameter], slot: int, flat: torch.Tensor, *,
                pack: bool) -> None:
        if not self.direct:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if pack:
                    _pack(params, flat)
            return
        import torch.distributed as dist

        off, whole = 0, self._slots[slot]
        for p in params:
            shard = p.ds_tensor  # [partition], this rank's piece of the flattened parameter
            world = dist.get_world_size(group=p.ds_process_group)
            total = shard.numel() * world
            if world == 1:  # the shard is the whole parameter (gloo's all-gather of one: 3-6x slower)
                whole[off: off + p.ds_numel].copy_(shard[: p.ds_numel])
            elif shard.dtype == whole.dtype:  # the padding spills into the next parameter's place
                _all_gather(whole[off: off + total], shard, p.ds_process_group)
            else:
                out = self._scratch_for(total, shard.dtype)
                _all_gather(out, shard, p.ds_process_group)
                whole[off: off + p.ds_numel].copy_(out[: p.ds_numel])
            off += p.ds_numel

    def _free_slot(self, slot: int, numel: int) -> torch.Tensor:
        """Slot `slot` as a flat [numel] buffer, once the broadcast that last read it is done."""
        work, self._works[slot] = self._works[slot], None
        if work is not None:
            work.wait()
        if not self._slots:
            m = self.manifest
            largest = max(m.bucket_numel(b) for b in range(len(m.buckets)))
            if self.direct:  # room for the zero padding of a bucket's last parameter
                largest += max(_gathered_numel(p) - p.ds_numel for p in self.params)
            self._slots = [torch.empty(largest, dtype=m.dtype, device=self.device) for _ in range(2)]
        return self._slots[slot][:numel]

    def _scratch_for(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._scratch is None or self._scratch.dtype != dtype:
            largest = max(_gathered_numel(p) for p in self.params)
            self._scratch = torch.empty(largest, dtype=dtype, device=self.device)
        return self._scratch[:numel]

    def stop(self) -> None:
        if self.group is not None:
            _bcast(self.group, torch.tensor([-1, FLAG_STOP, 0], dtype=torch.int64, device=self.device))


def _shard_gatherable(p: torch.nn.Parameter, device: torch.device) -> bool:
    """A plain ZeRO-3 partitioned parameter whose shard lives where the staging buffers do."""
    shard = getattr(p, "ds_tensor", None)
    return (shard is not None and getattr(p, "ds_secondary_tensor", None) is None
            and not hasattr(shard, "ds_quant_scale") and shard.device.type == device.type
            and getattr(p, "ds_process_group", None) is not None)


def _all_gather(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    """out[r * n: (r + 1) * n] = rank r's shard, for every rank r of `group`.

    On gloo as one broadcast per rank: gloo's all-gather moves ~3.5x less data per second than its
    broadcast (measured here: 200 MB over 2 ranks, 0.27 s vs 0.08 s). NCCL's all-gather is optimal.
    """
    import torch.distributed as dist

    if dist.get_backend(group) != "gloo":
        dist.all_gather_into_tensor(out, shard, group=group)
        return
    n, me = shard.numel(), dist.get_rank(group)
    out[me * n: (me + 1) * n].copy_(shard)
    works = [dist.broadcast(out[r * n: (r + 1) * n], dist.get_global_rank(group, r), group=group,
                            async_op=True) for r in range(dist.get_world_size(group))]
    for w in works:
        w.wait()


def _gathered_numel(p: torch.nn.Parameter) -> int:
    import torch.distributed as dist

    return p.ds_tensor.numel() * dist.get_world_size(group=p.ds_process_group)


def _pack(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy (and cast) gathered parameters into consecutive slices of `flat`, in one pass each."""
    off = 0
    for p in params:
        n = p.numel()
        flat[off: off + n].view(p.shape).copy_(p.data.detach())
        off += n


@dataclasses.dataclass
class StagedWeights:
    version: int
    flags: int
    tensors: list[tuple[str, torch.Tensor]]
    """(name, tensor in the wire dtype): views into the receiver's one version buffer; read them
    inside `WeightReceiver.reading()` (the next version overwrites the buffer)."""


@dataclasses.dataclass
class StreamedWeights:
    """A version whose buckets are still arriving (staging=stream): iterate `tensors()` once,
    straight into the engine; each bucket is received while the one before it is loaded."""

    version: int
    flags: int
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]


STAGING_MODES = ("device", "host", "stream")


def staging_bytes(manifest: Manifest, staging: str) -> int:
    """The searcher's sync memory (bytes the receiver allocates) for a manifest: device and host
    staging hold one whole version plus one bucket; stream holds two buckets."""
    itemsize = torch.empty((), dtype=manifest.dtype).element_size()
    bucket = max(manifest.bucket_numel(b) for b in range(len(manifest.buckets))) * itemsize
    if staging == "stream":
        return 2 * bucket
    if staging in ("device", "host"):
        return manifest.total_bytes + bucket
    raise ValueError(f"weight staging {staging!r} is not one of {STAGING_MODES}")


def resolve_staging(staging: str, device: str, manifest: Manifest, *,
                    free_bytes: int | None = None, headroom: float = 0.9) -> str:
    """searcher.staging with `auto` resolved: device when one staged version (and a bucket) fits
    in `headroom` of the engine GPU's free memory (`free_bytes`, measured once the engine holds
    its share), else host; host on CPU."""
    if staging != "auto":
        if staging not in STAGING_MODES:
            raise ValueError(f"searcher.staging={staging!r} is not auto or one of {STAGING_MODES}")
        return staging
    if torch.device(device).type != "cuda":
        return "host"
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(torch.device(device))[0]
    return "device" if staging_bytes(manifest, "device") <= headroom * free_bytes else "host"


class WeightReceiver:
    """Searcher side: a thread receives every version, bucket by bucket, into bounded staging.

    `device` is where broadcasts land (the sync group's device: cuda for NCCL). `staging`:

    - device: one version buffer on `device`, plus one bucket the broadcast lands in.
    - host: the version buffer in host memory (pinned when CUDA exists), plus one bucket on
      `device` (NCCL cannot receive into host memory).
    - stream: no version buffer; `take()` hands out a `StreamedWeights` as soon as a version's
      header arrived and the buckets are received while the engine loads them. At most two
      buckets are allocated at a time (one being loaded, one being received). The learner's
      broadcast of a bucket completes only once this searcher posts its receive, so with
      between-rounds updates a streamed version holds the learner until the round ends.

    Memory (`staging_bytes`): device/host = one whole version + one bucket; stream = two buckets
    (the largest bucket of the manifest, in its wire dtype, which is the engine's dtype with
    `learner.sync_wire_dtype=auto`). Only one version is ever staged: a version that arrives
    before the previous one was taken replaces it. A vLLM layer whose parameters straddle more
    than two buckets keeps the earlier ones referenced until it is complete (vLLM's layer-wise
    reload), so stream's bound needs buckets no smaller than one layer. `peak_staging_bytes`
    counts every byte the receiver allocated, measured, not computed.
    """

    def __init__(self, manifest: Manifest, group, *, device: str = "cpu", staging: str = "host"):
        if staging not in STAGING_MODES:
            raise ValueError(f"weight staging {staging!r} is not one of {STAGING_MODES} "
                             "(resolve auto with resolve_staging)")
        self.manifest, self.group, self.device, self.staging = manifest, group, device, staging
        self._cond = threading.Condition()
        self._latest: StagedWeights | StreamedWeights | None = None
        self._complete: StagedWeights | None = None  # the whole version in the buffer
        self._readers = 0
        self._version_buf: torch.Tensor | None = None
        self._bucket: torch.Tensor | None = None
        self._pending_eval: list[int] = []
        self._credits = threading.Semaphore(2)  # stream: buckets allocated at once
        self._buckets: queue.Queue = queue.Queue()
        self._consumed = threading.Event()
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
                header = torch.zeros(3, dtype=torch.int64, device=self.device)
                _bcast(self.group, header)
                version, flags, nb = (int(x) for x in header)
                if flags & FLAG_STOP:
                    return
                if nb != len(self.manifest.buckets):
                    raise RuntimeError(f"sync header announces {nb} buckets, manifest has "
                                       f"{len(self.manifest.buckets)}")
                if self.staging == "stream":
                    self._stream(version, flags)
                else:
                    self._stage(version, flags)
        except BaseException as e:  # surfaced to the searcher's main loop by take()
            self.error = e
            self._buckets.put(None)  # a consumer waiting for a bucket wakes up and raises
        finally:
            with self._cond:
                self.stopped = True
                self._cond.notify_all()

    def _alloc(self, numel: int, device, *, pin: bool = False) -> torch.Tensor:
        """A buffer whose bytes count as staging until the last view of it is gone."""
        t = torch.empty(numel, dtype=self.manifest.dtype, device=device, pin_memory=pin)
        nbytes = t.numel() * t.element_size()
        with self._cond:
            self.staging_now += nbytes
            self.peak_staging_bytes = max(self.peak_staging_bytes, self.staging_now)
        weakref.finalize(t, self._freed, nbytes)
        return t

    def _freed(self, nbytes: int) -> None:
        with self._cond:
            self.staging_now -= nbytes

    def _largest_bucket(self) -> int:
        m = self.manifest
        return max(m.bucket_numel(b) for b in range(len(m.buckets)))

    def _stage(self, version: int, flags: int) -> None:
        """Device/host staging: each bucket lands in the bucket buffer, then is copied into the
        version buffer (never while the main thread reads it)."""
        m, starts = self.manifest, self.manifest.bucket_starts
        if self._version_buf is None:
            host = self.staging == "host"
            where = "cpu" if host else self.device
            self._version_buf = self._alloc(m.numel, where, pin=host and torch.cuda.is_available())
            self._bucket = self._alloc(self._largest_bucket(), self.device)
        flat = self._version_buf
        for b in range(len(m.buckets)):
            part = self._bucket[: m.bucket_numel(b)]
            _bcast(self.group, part)
            with self._cond:
                self._cond.wait_for(lambda: self._readers == 0)
                self._latest = self._complete = None  # the buffer no longer holds a whole version
                flat[starts[b]: starts[b + 1]].copy_(part)
                if part.is_cuda or flat.is_cuda:  # the main thread reads on its own stream
                    torch.cuda.current_stream(part.device if part.is_cuda else flat.device).synchronize()
        staged = StagedWeights(version, flags, _views(m, flat, 0))
        with self._cond:
            self._latest = self._complete = staged
            self._announce(version, flags)

    def _stream(self, version: int, flags: int) -> None:
        """Stream staging: hand the version out now, receive each bucket once a credit is free."""
        m = self.manifest
        self._consumed.clear()
        with self._cond:
            self._latest = StreamedWeights(version, flags, functools.partial(self._consume, version))
            self._announce(version, flags)
        for b in range(len(m.buckets)):
            self._credits.acquire()
            buf = self._alloc(m.bucket_numel(b), self.device)
            _bcast(self.group, buf)
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()
            self._buckets.put((b, buf))
            del buf  # the consumer (and vLLM's layer-wise reload) holds the only references
        self._consumed.wait()

    def _consume(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        m = self.manifest
        try:
            for b in range(len(m.buckets)):
                item = self._buckets.get()
                if item is None:
                    raise RuntimeError(f"weight receiver failed: {self.error}") from self.error
                got, buf = item
                assert got == b, (got, b)
                try:
                    yield from _bucket_views(m, b, buf)
                finally:
                    del buf, item
                    self._credits.release()
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
            for _ in latest.tensors():
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
        while self._thread.is_alive():
            if self.staging == "stream":
                self.drain()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self._thread.join(0.05 if left is None else min(0.05, left))


def _views(m: Manifest, flat: torch.Tensor, first: int) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of every parameter from index `first` on, laid out from flat[0]."""
    out, off = [], 0
    for name, shape in zip(m.names[first:], m.shapes[first:]):
        n = math.prod(shape)
        out.append((name, flat[off: off + n].view(shape)))
        off += n
    return out


def _bucket_views(m: Manifest, b: int, buf: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    off = 0
    for i in m.buckets[b]:
        n = math.prod(m.shapes[i])
        yield m.names[i], buf[off: off + n].view(m.shapes[i])
        off += n
