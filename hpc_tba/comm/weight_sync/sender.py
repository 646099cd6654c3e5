"""Learner side of the weight sync: ZeRO-3 gathers into two alternating staging slots, each bucket
broadcast while the next one is gathered; out-of-process engines are fed from held host copies
(feeds.py)."""
from __future__ import annotations

import math
import time

import torch

from hpc_tba.comm.weight_sync.feeds import VERSIONS_HELD, Feed, HeldVersions
from hpc_tba.comm.weight_sync.group import broadcast_async, post_header, stop_receivers, sync_stream
from hpc_tba.comm.weight_sync.manifest import Manifest
from hpc_tba.comm.weight_sync.worker_groups import EngineGroups


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

    Each bucket goes on the sync group (searchers whose engine runs in their process), and, once
    any out-of-process engine joined (worker_groups.py), into one of `versions_held` host copies
    that the engines' feeds broadcast at each engine's own pace (feeds.py): `send` never waits
    for an engine. A bucket in place in host memory is lent to the copy instead of copied: the
    learner calls `before_update` before it next changes its parameters. A broadcast to an
    engine that died drops that engine's group, nothing else.
    """

    def __init__(self, module: torch.nn.Module, manifest: Manifest, group, *, device: str = "cpu",
                 direct_gather: bool = True, versions_held: int = VERSIONS_HELD):
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
        self._works: list[list] = [[], []]  # (searcher or None, Work) of the broadcasts of each slot
        # room for the zero padding a direct gather spills past a bucket's last parameter
        self._room = max(_gathered_numel(p) - p.ds_numel for p in self.params) if self.direct else 0
        self.held = HeldVersions(manifest, versions_held, room=self._room,
                                 device="meta" if self.device.type == "meta" else "cpu",
                                 pin=self.device.type == "cuda")
        """Host copies of recent versions on this node, read by the engines' feeds (feeds.py)."""
        self.engines = EngineGroups(group, feed=self._feed) if group is not None else None
        """Out-of-process engines' groups (worker_groups.py), each with its feed."""
        self._scratch: torch.Tensor | None = None  # gathers whose dtype differs from the wire's
        self.last_timing: dict[str, float] = {}
        """Seconds of the last `send` spent gathering+packing, and blocked on broadcasts."""

    def send(self, version: int, *, flags: int = 0) -> int:
        """Gather and broadcast every bucket; returns bytes broadcast (0 on ranks other than 0).

        Every learner rank joins the gathers (collectives on the learners' group) while rank 0's
        broadcast of the previous bucket is in flight on the sync group. The version is announced
        on the host first (the group's store), so receivers post no receive between syncs.
        Returns once every broadcast on the sync group has completed, on the host (with NCCL the
        stream is synchronized too), and the version is held for the engines' feeds, which
        broadcast it to out-of-process engines in their own threads (not waited for here: their
        time to completion is `feed_metrics`'s).
        """
        m, root = self.manifest, self.group is not None
        groups, h = [], None
        if root:  # [version, flags, buckets, data on the sync group, engine generation per searcher]
            gens = self.engines.refresh()
            on_sync = not self.engines.all_registered
            groups = [(None, self.group)] if on_sync else []
            post_header(self.group, [version, flags, len(m.buckets), int(on_sync), *gens])
            if self.engines.feeds():  # the feeds see it from its first written bucket on
                h = self.held.begin(version, flags)
        sent, t_gather, t_wait = 0, 0.0, 0.0
        try:
            for b, idx in enumerate(m.buckets):
                t0 = time.perf_counter()
                nbytes, waited = self._bucket(b, idx, groups, h)
                sent, t_wait = sent + nbytes, t_wait + waited
                t_gather += time.perf_counter() - t0 - waited
        except BaseException:
            if h is not None:
                self.held.abort(h)
            raise
        t0 = time.perf_counter()
        if root:
            for slot in range(len(self._works)):
                self._free_slot(slot, 0)
            sync_stream(self.device)  # NCCL: Work.wait() only made the stream wait
        self.last_timing = {"gather_pack_s": t_gather, "wait_s": t_wait + time.perf_counter() - t0}
        return sent

    def _bucket(self, b: int, idx: tuple[int, ...], groups: list, h: int | None) -> tuple[int, float]:
        """Gather bucket b (rank 0: post it on `groups`, write it into held copy h); returns its
        bytes sent and the seconds spent waiting for a free slot."""
        m, root = self.manifest, self.group is not None
        numel = m.bucket_numel(b)
        t0 = time.perf_counter()
        # other learner ranks need a slot only as the all-gather's output
        room = self._free_slot(b % 2, None) if root or self.direct else None
        waited = time.perf_counter() - t0
        keep = None
        if h is not None:  # on CPU the gather's output is the held copy itself
            keep = self.held.region(h, b)
            if keep.device.type == self.device.type:
                room = keep
            keep = keep[:numel]
        flat = room[:numel] if room is not None else None
        if not root:
            self._gather([self.params[i] for i in idx], b % 2, room, pack=False)
            return 0, waited
        # each piece goes as soon as it is gathered: the rest's gather overlaps it
        whole = self._in_place(idx)
        src = flat if whole is None else whole  # in place: the bucket goes from where it lies
        post = _Pieces(src, m.piece_numel, self._works[b % 2], groups)
        if whole is None:
            self._gather([self.params[i] for i in idx], b % 2, room, pack=True, ready=post)
        post(src.numel())
        if keep is not None:
            event = None
            if whole is not None and whole.device == keep.device:  # in place in host memory:
                self.held.wrote(h, b, lent=whole)  # lent until `before_update` (copy on write)
            else:
                if keep.data_ptr() != src.data_ptr():  # in place on a GPU, or a device slot
                    keep.copy_(src, non_blocking=keep.device != src.device)
                    if src.device.type == "cuda":  # CUDA branch (tests/test_gpu.py)
                        event = torch.cuda.Event()
                        event.record()
                self.held.wrote(h, b, event)
        return src.numel() * src.element_size(), waited

    def before_update(self) -> int:
        """Call before this learner changes its parameters (optimizer step, checkpoint load): the
        held copies copy what they borrowed and a feed may still read, and the broadcasts in flight
        from the parameters finish (`HeldVersions.reclaim`). Returns the buckets copied."""
        return self.held.reclaim()

    def _feed(self, i: int, gen: int, pg, store, on_failure) -> Feed:
        """The feed of searcher i's engine group (generation `gen`) over this sender's held copies."""
        return Feed(i, gen, pg, store, self.held, device=str(self.device), on_failure=on_failure)

    def feed_metrics(self) -> dict[str, float]:
        """Out-of-process engines' side of the sync (rank 0, feeds.py): the slowest feed's last
        transfer to completion, versions the feeds skipped, versions not held (every copy read)."""
        feeds = self.engines.feeds() if self.engines is not None else []
        if not feeds:
            return {}
        last = [f.times[-1] for f in feeds if f.times]
        return {"sync/engine_time_s": max(last) if last else 0.0,
                "sync/engine_versions_skipped": float(sum(f.skipped for f in feeds)),
                "sync/versions_unheld": float(self.held.unheld),
                "sync/reclaimed_buckets": float(self.held.reclaimed),
                "sync/reclaim_s": self.held.reclaim_s}

    def _gather(self, params: list[torch.nn.Parameter], slot: int, flat: torch.Tensor, *,
                pack: bool, ready=None) -> None:
        """Gather `params` into `flat` (slot `slot`'s buffer or a held copy from the bucket's
        start on: room for the zero padding a parameter spills past the bucket); `ready(n)` (rank
        0) each time flat[:n] holds its final bytes (the padding spills only past n)."""
        if not self.direct:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if pack:
                    _pack(params, flat)
            return
        import torch.distributed as dist

        off, whole = 0, flat
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
            if ready is not None:
                ready(off)

    def _in_place(self, idx: tuple[int, ...]) -> torch.Tensor | None:
        """The bucket of parameters `idx` as one view of the memory they already occupy, or None.

        Where a bucket's parameters are whole on this rank (plain parameters, or ZeRO-3 shards of a
        group of one), in the wire dtype, and back to back in one storage in manifest order (a model
        built as views of one buffer; one ZeRO-3 learner's flat partition after
        `deepspeed.initialize` with its optimizer: tests/test_weight_sync.py), they are the bucket
        already: it is broadcast from there, with no gather and no copy into a slot (measured on 2
        CPU cores with 64 MiB buckets: the pack was 0.31 s of CPU a 2 GB sync,
        tools/bench_weight_sync.py). Nothing on this path runs a collective, so other learner ranks
        gathering their own way stay in step. Never on the meta device (the dry run counts the
        slots, which stay allocated)."""
        import torch.distributed as dist

        m = self.manifest
        if self.device.type == "meta":
            return None
        storage, start, end = None, 0, 0
        for i in idx:
            p = self.params[i]
            if self.direct:
                if dist.get_world_size(group=p.ds_process_group) != 1:
                    return None
                t = p.ds_tensor
            elif hasattr(p, "ds_id"):  # partitioned: only a gather makes it whole
                return None
            else:
                t = p.data
            n = math.prod(m.shapes[i])
            if (t.dtype != m.dtype or t.device != self.device or t.numel() < n
                    or not t.is_contiguous()):
                return None
            if storage is None:
                storage, start, end = t.untyped_storage(), t.storage_offset(), t.storage_offset()
            if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != end:
                return None
            end += n
        return torch.empty(0, dtype=m.dtype, device=self.device).set_(storage, start, (end - start,))

    def _free_slot(self, slot: int, numel: int | None) -> torch.Tensor:
        """Slot `slot` as a flat [numel] buffer (None: all of it, room for a gather's padding
        included), once the broadcasts on the sync group that last read it are done."""
        works, self._works[slot] = self._works[slot], []
        for _, work in works:
            work.wait()
        if not self._slots:
            m = self.manifest
            largest = m.largest_bucket_numel + self._room  # room: a bucket's last padding
            self._slots = [torch.empty(largest, dtype=m.dtype, device=self.device) for _ in range(2)]
        return self._slots[slot][:numel]

    def _scratch_for(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self._scratch is None or self._scratch.dtype != dtype:
            largest = max(_gathered_numel(p) for p in self.params)
            self._scratch = torch.empty(largest, dtype=dtype, device=self.device)
        return self._scratch[:numel]

    def stop(self) -> None:
        """Stop the engines' feeds (each after the version it is sending), then the receivers."""
        if self.group is not None:
            self.engines.stop()
            stop_receivers(self.group)


class _Pieces:
    """Rank 0's broadcasts of one bucket: `self(n)` posts, to every target group, each piece of
    `piece` elements (the manifest's `piece_numel`; the last one shorter) that lies within
    flat[:n], in order; the Works go to `works` (the slot's, waited for before it is refilled)."""

    def __init__(self, flat: torch.Tensor, piece: int, works: list, targets: list):
        self.flat, self.piece, self.works, self.targets = flat, piece, works, targets
        self.sent = 0

    def __call__(self, ready: int) -> None:
        end = self.flat.numel()
        while self.sent < end:
            stop = min(self.sent + self.piece, end)
            if stop > ready:
                return
            part = self.flat[self.sent: stop]
            self.works.extend((i, broadcast_async(pg, part)) for i, pg in self.targets)
            self.sent = stop


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
