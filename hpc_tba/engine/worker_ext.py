"""Weights from a searcher's process into the workers of an out-of-process vLLM engine.

An out-of-process engine (vLLM V1 multiprocessing: the EngineCore and its workers are child
processes; tensor parallelism always works this way) cannot take tensors by a direct call. The
searcher's process keeps receiving the learner's broadcast as before (`comm/weight_sync/`) and
then hands the staged buffers on to the engine's workers, one hop on the same node:

- CPU staging: a small **per-engine** gloo group, rank 0 = the searcher's process, ranks 1..TP =
  the engine's workers. It is built with the engine on a fresh TCPStore port, so a rebuilt engine
  gets a fresh group and the learners' weight-sync group is never touched.
- CUDA staging: CUDA IPC. NCCL (>= 2.5) refuses two ranks on one GPU, and the searcher's process
  stages on cuda:0, which is also worker 0's GPU, so an NCCL group of the two cannot be built.
  Instead every worker maps the staged buffer (an IPC handle, no copy on the sending side) and
  loads from it; workers on other GPUs read it peer to peer.

Either way the weights travel as flat buckets described by a `Manifest` sent with the RPC, and the
workers load them in place inside one `collective_rpc` call through `reload_weights` (vLLM's
layer-wise reload, the same call the in-process engine makes), streaming bucket by bucket.

`WeightHopExtension` is mixed into vLLM's worker class (`worker_extension_cls`); it runs in the
engine's processes, so this module imports only torch and `comm/weight_sync/` (no MPI).
"""
from __future__ import annotations

import datetime
import pickle
import threading
from collections.abc import Callable, Iterator

import torch

from hpc_tba.comm.weight_sync import Manifest, broadcast_async

EXTENSION = f"{__name__}.WeightHopExtension"
"""The `worker_extension_cls` an out-of-process engine is built with."""

BUCKET_BYTES = 64 << 20
"""Largest bucket on the hop (the workers hold one bucket and the next in flight)."""


class EngineWeightChannel:
    """The searcher's end of the hop to one engine's workers.

    `rpc(method, **kwargs)` calls a method of every worker and returns their results (vLLM's
    `LLM.collective_rpc`). `num_workers` is the engine's tensor-parallel size. A channel that
    failed mid-transfer is broken for good: the engine must be rebuilt (with a fresh channel).
    """

    def __init__(self, rpc: Callable[..., list], *, num_workers: int, device: str,
                 bucket_bytes: int = BUCKET_BYTES, timeout_s: float = 600.0):
        self.rpc, self.num_workers = rpc, num_workers
        self.device = torch.device(device)
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.group, self._store = None, None
        self.broken: str | None = None
        self._scratch: torch.Tensor | None = None
        if self.device.type == "cpu":
            self._join_group()
        elif self.device.type != "cuda":
            raise ValueError(f"engine weight hop: no transport for device {device!r}")

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

    def send(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Every worker loads `named_tensors` (Hugging Face names) in place; returns when done."""
        if self.broken:
            raise RuntimeError(f"engine weight hop is broken ({self.broken}); rebuild the engine")
        if not named_tensors:
            raise ValueError("engine weight hop: no tensors to load")
        dtype = named_tensors[0][1].dtype
        manifest = Manifest.build([(n, tuple(t.shape)) for n, t in named_tensors],
                                  bucket_bytes=self.bucket_bytes, wire_dtype=dtype)
        flat = self._flat(named_tensors, manifest)
        try:
            if self.group is not None:
                self._send_group(flat, manifest)
            else:
                self._send_ipc(flat, manifest)
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            if self.group is not None:  # pending sends would otherwise wait out the timeout
                self.group.abort()
            raise

    def _send_group(self, flat: torch.Tensor, manifest: Manifest) -> None:
        starts = manifest.bucket_starts
        works = [broadcast_async(self.group, flat[starts[b]: starts[b + 1]])
                 for b in range(len(manifest.buckets))]
        counts = self.rpc("hpc_tba_receive_weights", manifest=manifest.to_json())
        for w in works:
            w.wait()
        self._check(counts, manifest)

    def _send_ipc(self, flat: torch.Tensor, manifest: Manifest) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(flat)  # the handle keeps `flat` alive until the workers let go
        uuid = str(torch.cuda.get_device_properties(flat.device).uuid)
        counts = self.rpc("hpc_tba_receive_weights", manifest=manifest.to_json(),
                          ipc=pickle.dumps((uuid, args)))
        self._check(counts, manifest)

    def _check(self, counts: list[int], manifest: Manifest) -> None:
        if counts != [manifest.numel] * self.num_workers:
            raise RuntimeError(f"engine weight hop: workers loaded {counts} elements, expected "
                               f"{manifest.numel} each")

    def _flat(self, named_tensors: list[tuple[str, torch.Tensor]], manifest: Manifest) -> torch.Tensor:
        """One flat buffer holding every tensor in order: the staging buffer itself when the
        tensors are consecutive views of it (what `WeightReceiver` hands out), else a packed copy."""
        tensors = [t for _, t in named_tensors]
        flat = _consecutive_views(tensors)
        if flat is not None and flat.device.type == self.device.type:
            return flat
        if self._scratch is None or self._scratch.numel() < manifest.numel or \
                self._scratch.dtype != manifest.dtype:
            self._scratch = torch.empty(manifest.numel, dtype=manifest.dtype, device=self._device())
        off = 0
        for t in tensors:
            self._scratch[off: off + t.numel()].view(t.shape).copy_(t)
            off += t.numel()
        return self._scratch[: manifest.numel]

    def _device(self) -> torch.device:
        if self.device.type == "cuda" and self.device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return self.device

    def close(self) -> None:
        """Drop the group (its peers may already be dead: nothing is waited for)."""
        group, self.group, self._store = self.group, None, None
        if group is not None and self.broken:
            group.abort()


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


class WeightHopExtension:
    """Mixed into vLLM's worker class: the workers' end of `EngineWeightChannel`.

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

    def hpc_tba_receive_weights(self, manifest: dict, ipc: bytes | None = None) -> int:
        """Receive every bucket and load it in place; returns the number of elements loaded."""
        m = Manifest.from_json(manifest)
        loaded = [0]
        buckets = _ipc_buckets(m, ipc) if ipc is not None else _group_buckets(
            m, self._hpc_tba_group[0])

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for b, flat in buckets:
                yield from m.bucket_views(b, flat)
                loaded[0] += m.bucket_numel(b)

        self.reload_weights(weights_iterator=tensors())
        from hpc_tba.models.naming import refresh_tied_heads

        runner = getattr(self, "model_runner", None)  # a vLLM worker has one (test doubles may not)
        if runner is not None:
            refresh_tied_heads(runner.get_model())  # a tied head's CPU copy is stale otherwise
        if ipc is not None:
            torch.cuda.synchronize()  # every read of the sender's buffer has finished
        return loaded[0]


def _group_buckets(m: Manifest, group) -> Iterator[tuple[int, torch.Tensor]]:
    """Buckets off the per-engine group, the next one in flight while one is loaded.

    Each bucket gets a fresh buffer: vLLM's layer-wise reload keeps the tensors of a layer until
    the layer is complete, which may be after the next bucket arrived.
    """
    def post(b: int):
        buf = torch.empty(m.bucket_numel(b), dtype=m.dtype)
        return buf, broadcast_async(group, buf)

    pending = post(0) if m.buckets else None
    for b in range(len(m.buckets)):
        buf, work = pending
        pending = post(b + 1) if b + 1 < len(m.buckets) else None
        work.wait()
        yield b, buf


def _ipc_buckets(m: Manifest, ipc: bytes) -> Iterator[tuple[int, torch.Tensor]]:
    """Buckets as views of the sender's CUDA buffer (mapped once, read in place)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid, args = pickle.loads(ipc)
    args = list(args)
    args[6] = _device_index(uuid)  # the sender's device, in this process's numbering
    flat = rebuild_cuda_tensor(*args)
    starts = m.bucket_starts
    for b in range(len(m.buckets)):
        yield b, flat[starts[b]: starts[b + 1]]


def _device_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(f"engine weight hop: the searcher's GPU {uuid} is not visible to this worker")
