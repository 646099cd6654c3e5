"""Weight sync: learner rank 0 broadcasts the policy to every searcher, a bucket at a time.

The sync group is its own process group (learner rank 0 + all searchers) built from a TCPStore,
independent of the learners' default group that DeepSpeed uses, so ZeRO-3 collectives and weight
broadcasts never share a communicator. Backend `gloo` on CPU and `nccl` on GPU: same code.

Protocol, per sync: a header int64 [version, flags, num_buckets], then one flat buffer per
bucket in manifest order. The manifest (parameter names and shapes in a fixed order, split into
buckets of at most `bucket_bytes`) is agreed once at setup, so no per-parameter message is ever
sent. Learner ranks other than 0 join only the ZeRO-3 gathers. On the searcher a background
thread receives into staging tensors, so a broadcast completes while the engine is generating;
the searcher applies the newest staged version between generation rounds.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import threading
from collections.abc import Iterator

import torch

FLAG_EVAL = 1
"""The searchers should evaluate this version on the held-out split."""
FLAG_STOP = 2
"""No more versions: receivers exit."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Parameter names and shapes in broadcast order, grouped into buckets."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    buckets: tuple[tuple[int, ...], ...]  # indices into names

    @classmethod
    def build(cls, named_shapes: list[tuple[str, tuple[int, ...]]], *, bucket_bytes: int,
              itemsize: int = 4) -> "Manifest":
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
                   tuple(buckets))

    def to_json(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "buckets": [list(b) for b in self.buckets]}

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        return cls(tuple(d["names"]), tuple(tuple(s) for s in d["shapes"]),
                   tuple(tuple(b) for b in d["buckets"]))

    def bucket_numel(self, b: int) -> int:
        return sum(math.prod(self.shapes[i]) for i in self.buckets[b])

    @property
    def total_bytes(self) -> int:
        return 4 * sum(math.prod(s) for s in self.shapes)


_STORES: list = []


def new_group(*, host: str, port: int, rank: int, size: int, backend: str,
              timeout_s: float = 1800.0) -> torch.distributed.ProcessGroup:
    """A standalone process group of `size` members (rank 0 hosts the store)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=(rank == 0), timeout=timeout)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, size, timeout)
    elif backend == "nccl":
        pg = dist.ProcessGroupNCCL(store, rank, size)
    else:
        raise ValueError(f"weight-sync backend {backend!r} is not gloo or nccl")
    _STORES.append(store)  # the group needs its store for as long as the process lives
    return pg


def _bcast(pg, tensor: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


class WeightSender:
    """Learner side. Every learner rank calls `send`; only rank 0 has a group and broadcasts."""

    def __init__(self, module: torch.nn.Module, manifest: Manifest, group, *, device: str = "cpu"):
        params = dict(module.named_parameters())
        missing = [n for n in manifest.names if n not in params]
        if missing:
            raise ValueError(f"weight manifest names parameters the model lacks: {missing[:3]}")
        self.params = [params[n] for n in manifest.names]
        self.manifest = manifest
        self.group = group
        self.device = device

    def send(self, version: int, *, flags: int = 0) -> int:
        """Gather and broadcast every bucket; returns bytes broadcast (0 on ranks other than 0)."""
        import deepspeed

        GatheredParameters = deepspeed.zero.GatheredParameters

        m = self.manifest
        if self.group is not None:
            _bcast(self.group, torch.tensor([version, flags, len(m.buckets)], dtype=torch.int64))
        sent = 0
        for b, idx in enumerate(m.buckets):
            params = [self.params[i] for i in idx]
            with GatheredParameters(params, modifier_rank=None):
                if self.group is None:
                    continue
                flat = torch.cat([p.data.detach().reshape(-1).to(self.device, torch.float32)
                                  for p in params])
            _bcast(self.group, flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def stop(self) -> None:
        if self.group is not None:
            _bcast(self.group, torch.tensor([-1, FLAG_STOP, 0], dtype=torch.int64))


@dataclasses.dataclass
class StagedWeights:
    version: int
    flags: int
    tensors: list[tuple[str, torch.Tensor]]


class WeightReceiver:
    """Searcher side: a thread receives every version into staging tensors; `take()` the newest."""

    def __init__(self, manifest: Manifest, group, *, device: str = "cpu"):
        self.manifest = manifest
        self.group = group
        self.device = device
        self._lock = threading.Lock()
        self._latest: StagedWeights | None = None
        self._pending_eval: list[int] = []
        self.received_versions: list[int] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="weight-receiver", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                header = torch.zeros(3, dtype=torch.int64)
                _bcast(self.group, header)
                version, flags, nb = (int(x) for x in header)
                if flags & FLAG_STOP:
                    return
                if nb != len(self.manifest.buckets):
                    raise RuntimeError(f"sync header announces {nb} buckets, manifest has "
                                       f"{len(self.manifest.buckets)}")
                tensors = list(self._receive_buckets())
                with self._lock:
                    self._latest = StagedWeights(version, flags, tensors)
                    self.received_versions.append(version)
                    if flags & FLAG_EVAL:
                        self._pending_eval.append(version)
        except BaseException as e:  # surfaced to the searcher's main loop by take()
            self.error = e

    def _receive_buckets(self) -> Iterator[tuple[str, torch.Tensor]]:
        m = self.manifest
        for b, idx in enumerate(m.buckets):
            flat = torch.empty(m.bucket_numel(b), dtype=torch.float32, device=self.device)
            _bcast(self.group, flat)
            off = 0
            for i in idx:
                n = math.prod(m.shapes[i])
                yield m.names[i], flat[off: off + n].view(m.shapes[i])
                off += n

    def take(self) -> tuple[StagedWeights | None, list[int]]:
        """The newest staged weights not yet taken (or None) and versions awaiting evaluation."""
        if self.error is not None:
            raise RuntimeError(f"weight receiver failed: {self.error}") from self.error
        with self._lock:
            latest, self._latest = self._latest, None
            evals, self._pending_eval = self._pending_eval, []
        return latest, evals

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
