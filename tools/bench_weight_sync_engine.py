"""The out-of-process lines of tools/bench_weight_sync.py (its docstring says what they measure):
the learner's `WeightSender` -> a TP=2 stand-in engine whose two worker processes (the real
worker extension, a copying loader) receive every bucket on their engine group, while the
searcher's `WeightReceiver` only decides; against one flat broadcast of the same bytes on that
group, and the same buckets back to back."""
from __future__ import annotations

import statistics
import time

import torch

from hpc_tba.comm.groups import free_ports

WARMUP = 2  # the receivers' staging pool holds two buffers after two versions: no page faults later


def named_shapes(cfg) -> list[tuple[str, tuple[int, ...]]]:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _barrier(pg) -> None:
    pg.allreduce([torch.zeros(1)]).wait()


class _StandInWorker:
    """A stand-in engine worker: the real worker extension (`WeightHopExtension`, whose
    `WorkerSyncMixin` joins the learner's broadcast), a copying `reload_weights`."""

    def __init__(self, rank: int, shapes):
        from hpc_tba.engine.worker_ext import WeightHopExtension

        class Worker(WeightHopExtension):
            pass

        self.w = Worker()
        self.w.rank = rank
        self.params = {n: torch.zeros(s) for n, s in shapes}
        self.w.reload_weights = self.reload_weights
        self.w.raw = self.raw

    def reload_weights(self, weights_iterator) -> None:
        for name, t in weights_iterator:
            self.params[name].copy_(t)

    def raw(self, numel: int, repeats: int, sizes: list[int] | None = None) -> None:
        """The raw baselines: `repeats` + 1 broadcasts of `numel` fp32 on the engine group itself,
        into one buffer allocated (and faulted in) before the first: one flat broadcast, or (with
        `sizes`) one per bucket, back to back (no loader, no allocation, no decision). The syncs
        are over: the parameters are dropped first (a 2 GiB model twice per worker otherwise)."""
        from hpc_tba.comm.weight_sync import broadcast_async

        self.params = {}
        buf = torch.zeros(numel)
        for _ in range(repeats + 1):
            for part in _cut(buf, sizes):
                broadcast_async(self.w._hpc_tba_sync.group, part).wait()


def _cut(flat: torch.Tensor, sizes: list[int] | None) -> tuple[torch.Tensor, ...]:
    """`flat` whole, or as consecutive views of `sizes` elements."""
    return (flat,) if sizes is None else flat.split(sizes)


def _serve_worker(rank: int, conn, shapes) -> None:
    torch.set_num_threads(1)
    worker = _StandInWorker(rank, shapes)
    while (msg := conn.recv()) is not None:
        method, kwargs = msg
        conn.send(getattr(worker.w, method)(**kwargs))


class _StandInEngine:
    """Two worker processes and a `collective_rpc` over pipes: what `WeightReceiver.serve_engine`
    and `VLLMEngine.load_weights` use of an out-of-process engine."""

    in_process = False

    class cfg:  # noqa: N801 - SearcherConfig's field
        tensor_parallel_size = 2

    def __init__(self, shapes):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(2)]
        self.conns = [a for a, _ in pipes]
        self.procs = [ctx.Process(target=_serve_worker, args=(r, b, shapes), daemon=True)
                      for r, (_, b) in enumerate(pipes)]
        for p in self.procs:
            p.start()

    def rpc(self, method, **kwargs):
        for c in self.conns:
            c.send((method, kwargs))
        return [c.recv() for c in self.conns]

    def join_weight_sync(self, slot, manifest) -> None:
        from hpc_tba.engine.worker_sync import join_workers

        join_workers(self.rpc, slot, manifest, {})

    def close(self) -> None:
        self.rpc("hpc_tba_leave_sync")
        for c, p in zip(self.conns, self.procs):
            c.send(None)
            p.join(timeout=30)


class _Flat(torch.nn.Module):
    """The learner's model for the out-of-process rows: plain parameters of the given shapes,
    views of one flat buffer (`self.flat`, also what the learner's raw broadcasts send: no second
    copy of the model)."""

    def __init__(self, shapes):
        super().__init__()
        self.names = [n for n, _ in shapes]
        sizes = [torch.Size(s).numel() for _, s in shapes]
        self.flat = torch.randn(sum(sizes))
        for i, (part, (_, s)) in enumerate(zip(self.flat.split(sizes), shapes)):
            self.register_parameter(f"p{i}", torch.nn.Parameter(part.view(s)))

    def named_parameters(self, *args, **kwargs):
        return zip(self.names, (p for _, p in super().named_parameters()))


def _engine_worker(rank: int, args, ports: list[int], shapes, bucket: int, out) -> None:
    """Rank 0: the learner (`WeightSender`); rank 1: the searcher (`WeightReceiver` serving a
    TP=2 stand-in engine whose workers receive every bucket themselves)."""
    from hpc_tba.comm.weight_sync import Manifest, WeightReceiver, WeightSender, broadcast_async, new_group
    from hpc_tba.engine.worker_sync import load_version

    torch.set_num_threads(1)
    m = Manifest.build(shapes, bucket_bytes=bucket)
    sync = new_group(host="127.0.0.1", port=ports[0], rank=rank, size=2, backend="gloo")
    ctl = new_group(host="127.0.0.1", port=ports[1], rank=rank, size=2, backend="gloo")
    if rank == 1:
        engine = _StandInEngine(shapes)
        rx = WeightReceiver(m, sync, staging="stream")
        rx.serve_engine(engine)
    else:
        model = _Flat(shapes)
        sender = WeightSender(model, m, sync)
    _barrier(ctl)
    times, peaks, copied = [], [], 0
    for r in range(WARMUP + args.repeats):
        if rank == 0:  # the learner's step between syncs: the held copy gives back what it borrowed
            copied += sender.before_update()  # (copy on write: what the feed has not sent yet)
        _barrier(ctl)
        t0 = time.perf_counter()
        if rank == 0:
            sender.send(r + 1)
        else:
            assert rx.wait_for(r + 1, timeout=600)
            streamed, _ = rx.take()
            stats = load_version(engine.rpc, streamed.tensors())
            peaks.append(max([rx.peak_staging_bytes] + [s["peak_bytes"] for s in stats]))
            assert [s["numel"] for s in stats] == [m.numel] * 2
        _barrier(ctl)
        if r >= WARMUP:
            times.append(time.perf_counter() - t0)
    # raw: one flat broadcast of the same bytes, on the engine group (learner -> both workers)
    # and, for reference, on the sync group (learner -> the searcher's process)
    # (timed on the learner, each after the workers' buffer exists: the best that group can do)
    # and, for context, the same bytes as one broadcast per bucket on the engine group, back to
    # back into preallocated buffers (what a bucketed protocol costs on this group by itself)
    raws, raws_sync, raws_cut = [], [], []
    sizes = [m.bucket_numel(b) for b in range(len(m.buckets))]
    flat = model.flat if rank == 0 else None
    for cut, out_s in ((None, raws), (sizes, raws_cut)):
        _barrier(ctl)
        if rank == 0:
            [(_, group)] = sender.engines.groups()
            for r in range(args.repeats + 1):
                t0 = time.perf_counter()
                for w in [broadcast_async(group, part) for part in _cut(flat, cut)]:
                    w.wait()
                if r:
                    out_s.append(time.perf_counter() - t0)
        else:
            engine.rpc("raw", numel=m.numel, repeats=args.repeats, sizes=cut)
        _barrier(ctl)
    buf = torch.zeros(m.numel) if rank else flat
    for r in range(args.repeats + 1):
        _barrier(ctl)
        t0 = time.perf_counter()
        broadcast_async(sync, buf).wait()
        _barrier(ctl)
        if r:
            raws_sync.append(time.perf_counter() - t0)
    if rank == 0:
        sender.stop()
        out.put(("times", statistics.median(times), statistics.median(raws),
                 statistics.median(raws_sync), len(m.buckets), statistics.median(raws_cut),
                 copied, WARMUP + args.repeats))
    else:
        rx.join(timeout=60)
        out.put(("peak", max(peaks) / (m.largest_bucket_numel * 4), rx.peak_staging_bytes))
        engine.close()


def engine_shapes(bucket_bytes: int, buckets: int) -> list[tuple[str, tuple[int, ...]]]:
    """A narrow, deep Llama (every tensor <= 1 MiB fp32) with the fewest layers that make at
    least `buckets` buckets of `bucket_bytes` (Manifest.build's greedy cut: full buckets of one
    size, exactly `buckets` of them where a layer is smaller than a bucket)."""
    from transformers import LlamaConfig

    from hpc_tba.comm.weight_sync import Manifest

    hidden, inter, vocab = 256, 1024, 1024
    one = named_shapes(LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                                   num_attention_heads=8, num_key_value_heads=8, vocab_size=vocab,
                                   tie_word_embeddings=False))
    layer = [(n, s) for n, s in one if n.startswith("model.layers.0.")]
    outer = [(n, s) for n, s in one if not n.startswith("model.layers.")]

    def shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
        return outer[:1] + [(n.replace(".0.", f".{i}.", 1), s) for i in range(layers)
                            for n, s in layer] + outer[1:]

    def count(layers: int) -> int:
        return len(Manifest.build(shapes(layers), bucket_bytes=bucket_bytes).buckets)

    per_layer = sum(torch.Size(s).numel() for _, s in layer)
    layers = max(1, round((buckets * bucket_bytes / 4 - 2 * vocab * hidden) / per_layer))
    while layers > 1 and count(layers - 1) >= buckets:
        layers -= 1
    while count(layers) < buckets:
        layers += 1
    return shapes(layers)


def engine_process_rows(args, mb: float) -> None:
    """The out-of-process lines (module docstring) for `--engine-buckets` buckets of `mb` MiB:
    TP=2 stand-in workers in the broadcast."""
    import torch.multiprocessing as mp

    from hpc_tba.comm.weight_sync import Manifest

    bucket = int(mb * 2**20)
    shapes = engine_shapes(bucket, args.engine_buckets)
    total = 4 * sum(torch.Size(s).numel() for _, s in shapes)
    largest = 4 * Manifest.build(shapes, bucket_bytes=bucket).largest_bucket_numel
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_engine_worker, args=(args, free_ports(2), shapes, bucket, out), nprocs=2,
                       join=True, start_method="spawn")
    got = {}
    while not out.empty():
        item = out.get()
        got[item[0]] = item[1:]
    sync_s, raw_s, raw_sync_s, nb, raw_cut_s, copied, syncs = got["times"]
    print(f"engine processes (TP=2 stand-in workers in the learner's broadcast, fp32): "
          f"{total / 1e9:.3f} GB in {nb} buckets of <= {largest / 2**20:.1f} MiB; sync {sync_s:.3f} s "
          f"(learner send -> both workers loaded), raw broadcast on the engine group {raw_s:.3f} s, "
          f"learner -> searcher process {raw_sync_s:.3f} s (medians of {args.repeats}); searcher "
          f"process staging peak {got['peak'][1]} B; buckets the learner copied into its held "
          f"copy before its steps: {copied} of {nb * syncs} sent (the rest lent in place)")
    size = f"({nb} buckets of <= {largest / 2**20:.1f} MiB)"  # the per-message cost depends on it
    print(f"engine-process sync peak/bucket = {got['peak'][0]:.2f} {size}")
    print(f"engine-process sync / raw broadcast = {raw_s / sync_s:.2f} {size}")
    print(f"(context: the same bytes as {nb} back-to-back bucket broadcasts on the engine group, "
          f"preallocated, no loader: {raw_cut_s:.3f} s, raw / that = {raw_s / raw_cut_s:.2f}: "
          f"what bucket-by-bucket costs on this group by itself)")
