"""Benchmark: weight-sync throughput against one raw broadcast of the same bytes.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python tools/bench_weight_sync.py \
        [--params 100e6] [--learners 1] [--receivers 2] [--bucket-mb 16 64 256] [--repeats 3] \
        [--wire-dtype fp32|bf16] [--backend gloo|nccl]

Spawns learners + receivers on this machine. The learners hold a Llama (built locally from a
config, no download) under DeepSpeed ZeRO-3 (deepspeed.zero.Init on their own gloo group, then
deepspeed.initialize with an optimizer, as in a run: one learner's shards then lie in one flat
partition and its buckets go from there, `WeightSender._in_place`); learner rank 0 and the
receivers form the weight-sync group of `new_group`, exactly as in a run. For each
bucket size it times, on that same group:

- sync: `WeightSender.send` on every learner (ZeRO-3 gathers, packing, broadcasts) until every
  `WeightReceiver` has staged the version;
- raw:  one `broadcast` of a single flat buffer holding the same number of bytes, preallocated
  on every rank (the best the group can do).

Both are bracketed by the same barrier on a separate control group; the ratio is raw_s / sync_s
(goal >= 0.8). Medians of `--repeats` after two warm-up syncs (they allocate the staging buffers).
Then, for out-of-process engines (`--engine-bucket-mb`, one set of lines per size given;
`--engine-buckets`, 32 by default: the issue's 32+): a narrow, deep Llama cut into exactly that
many buckets of that size, by default the configured `learner.sync_bucket_mb` (LearnerConfig:
64 MiB, a 2 GiB fp32 model), because that is what a run broadcasts; the per-message cost of gloo
dominates far below it (`--engine-bucket-mb 64 1.3` adds the small-bucket lines; 0 skips them).
The learner's `WeightSender` -> two engine worker processes (tensor parallel 2, the real worker
extension with a stand-in loader that copies each tensor into its parameter: vLLM's own loader
is not timed) that receive every bucket themselves on their engine group, while the searcher's
`WeightReceiver` (serve_engine) only decides and asks them to load; it prints

    engine-process sync peak/bucket = X (N buckets of <= S MiB)   (most bucket-sized buffers alive
        in any one process)
    engine-process sync / raw broadcast = Y (N buckets of <= S MiB)   (raw s / engine-process
        sync s; raw: one flat broadcast of the same bytes on the same engine group, learner ->
        both workers)

and, for context, the same bytes as one broadcast per bucket on that group, back to back into
preallocated buffers with no loader: what a bucketed protocol costs on the group by itself.

The out-of-process lines live in tools/bench_weight_sync_engine.py. It ends with the analytic
time of a 70B bf16 sync over InfiniBand.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from bench_weight_sync_engine import WARMUP, _barrier, named_shapes

from hpc_tba.comm.groups import free_ports
from hpc_tba.config.learner import LearnerConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def llama_config(params: float):
    """A Llama of about `params` parameters: GPT-2-small width, 32k vocab, untied head."""
    from transformers import LlamaConfig

    hidden, inter, vocab = 768, 2048, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    return LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=12, num_key_value_heads=12, vocab_size=vocab,
                       tie_word_embeddings=False)


def _build_learner(args, rank: int, port: int, cfg):
    import deepspeed
    from transformers import LlamaForCausalLM

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.learners))
    deepspeed.init_distributed(dist_backend=args.backend, auto_mpi_discovery=False, verbose=False,
                               init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                               world_size=args.learners)
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}}
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = LlamaForCausalLM(cfg)
    # built as a run's learner is: with its optimizer, ZeRO-3 keeps the shards in one flat
    # partition (one learner: the buckets lie whole there, WeightSender._in_place)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    return engine.module


def _worker(rank: int, args, ports: list[int], shapes, cfg) -> None:
    from hpc_tba.comm.weight_sync import Manifest, new_group

    torch.set_num_threads(1)
    t_start = time.time()
    is_learner = rank < args.learners
    model = _build_learner(args, rank, ports[0], cfg) if is_learner else None
    sync = None
    if rank == 0 or not is_learner:  # learner rank 0 + the receivers
        sync_rank = 0 if rank == 0 else rank - args.learners + 1
        sync = new_group(host="127.0.0.1", port=ports[1], rank=sync_rank, size=args.receivers + 1,
                         backend=args.backend)
    ctl = new_group(host="127.0.0.1", port=ports[2], rank=rank,
                    size=args.learners + args.receivers, backend="gloo")
    if rank == 0:
        print(f"(setup: {time.time() - t_start:.0f} s)", file=sys.stderr, flush=True)
    first_version = 1
    for mb in args.bucket_mb:
        manifest = Manifest.build(shapes, bucket_bytes=int(mb * 2**20), wire_dtype=args.wire_dtype)
        sync_s, timing, exact = _time_syncs(args, model, manifest, sync, ctl, first_version)
        first_version += WARMUP + args.repeats
        raw_s = _time_raw(args, manifest, sync, ctl)
        if rank == 0:
            _print_row(mb, len(manifest.buckets), manifest.total_bytes, statistics.median(sync_s),
                       statistics.median(raw_s),
                       statistics.median(t["gather_pack_s"] for t in timing),
                       statistics.median(t["wait_s"] for t in timing), exact)


def _time_syncs(args, model, manifest, sync, ctl, first_version: int):
    """WeightSender -> WeightReceiver: WARMUP + repeats versions; times of the timed ones."""
    from hpc_tba.comm.weight_sync import WeightReceiver, WeightSender

    sender = WeightSender(model, manifest, sync) if model is not None else None
    receiver = WeightReceiver(manifest, sync) if model is None else None
    staged, times, timing = None, [], []
    for r in range(WARMUP + args.repeats):
        version = first_version + r
        _barrier(ctl)
        t0 = time.perf_counter()
        if sender is not None:
            sender.send(version)
        else:
            assert receiver.wait_for(version, timeout=600), f"version {version} never arrived"
            staged, _ = receiver.take()
        _barrier(ctl)
        if r >= WARMUP:
            times.append(time.perf_counter() - t0)
            timing.append(sender.last_timing if sender is not None else {})
    if sender is not None and sync is not None:
        sender.stop()
    if receiver is not None:
        receiver.join()
    return times, timing, _check(manifest, model, staged, ctl)


def _check(manifest, model, staged, ctl) -> bool:
    """Receivers compare the last version with the learners' own gather (GatheredParameters)."""
    want = torch.empty(manifest.numel, dtype=manifest.dtype)
    if model is not None:
        import deepspeed

        params = dict(model.named_parameters())
        params = [params[n] for n in manifest.names]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            torch.cat([p.data.reshape(-1).to(manifest.dtype) for p in params], out=want)
    ctl.broadcast([want]).wait()  # ctl rank 0 = learner rank 0
    ok = torch.tensor([1.0])
    if staged is not None:
        got = torch.cat([t.reshape(-1) for _, t in staged.tensors])
        ok[0] = float(torch.equal(got, want))
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = torch.distributed.ReduceOp.MIN
    ctl.allreduce([ok], opts).wait()
    return bool(ok[0])


def _time_raw(args, manifest, sync, ctl) -> list[float]:
    """One broadcast of a single flat buffer of the same bytes, on the same group."""
    from hpc_tba.comm.weight_sync import broadcast_async

    raw = None
    if sync is not None:
        raw = torch.full((manifest.numel,), float(sync.rank() == 0), dtype=manifest.dtype)
        broadcast_async(sync, raw).wait()  # warm-up
    times = []
    for _ in range(args.repeats):
        _barrier(ctl)
        t0 = time.perf_counter()
        if raw is not None:
            broadcast_async(sync, raw).wait()
        _barrier(ctl)
        times.append(time.perf_counter() - t0)
    return times


def _print_row(mb, nb, nbytes, sync_s, raw_s, pack_s, wait_s, exact) -> None:
    gb = nbytes / 1e9
    print(f"| {mb:10g} | {nb:7d} | {gb:6.3f} | {sync_s:6.3f} | {gb / sync_s:9.3f} | {raw_s:6.3f} "
          f"| {gb / raw_s:8.3f} | {raw_s / sync_s:5.2f} | {pack_s:13.3f} | {wait_s:6.3f} "
          f"| {'yes' if exact else 'NO':>9} |", flush=True)


def analytic_70b(link_gbit: float = 400.0, efficiency: float = 0.8, params: float = 70e9,
                 itemsize: int = 2) -> str:
    nbytes = params * itemsize
    link = link_gbit / 8 * 1e9  # bytes/s
    ideal, real = nbytes / link, nbytes / (link * efficiency)
    return (f"70B analytic: {nbytes / 1e9:.0f} GB (bf16) over {link_gbit:.0f} Gb/s InfiniBand "
            f"({link / 1e9:.0f} GB/s): {ideal:.1f} s at line rate, {real:.1f} s at "
            f"{efficiency:.0%} NCCL bus-bandwidth efficiency.\n"
            "  Assumes NCCL's pipelined ring/chain broadcast (bus bandwidth = algorithm bandwidth, so "
            "the time does not grow with the number of receiving GPUs, only latency per hop), one "
            "400 Gb/s NIC per GPU on the sending path, the ZeRO-3 all-gather of the next bucket "
            "hidden behind the broadcast (learner nodes have 8 NICs and NVLink), and receivers "
            "that already hold their staging memory. Divide by the measured ratio above for "
            "our overhead; fp32 on the wire doubles it.")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=100e6, help="model size (parameters)")
    p.add_argument("--learners", type=int, default=1, help="ZeRO-3 learner ranks (1-2)")
    p.add_argument("--receivers", type=int, default=2, help="searcher-side receivers")
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[16, 64, 256],
                   help="bucket sizes in MiB (one row each)")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per bucket size (median)")
    p.add_argument("--wire-dtype", default="fp32", help="fp32 or bf16")
    p.add_argument("--backend", default="gloo", help="gloo (CPU) or nccl")
    p.add_argument("--engine-bucket-mb", type=float, nargs="+", default=[LearnerConfig().sync_bucket_mb],
                   help="bucket sizes in MiB of the out-of-process rows, one set of lines each "
                        "(default: the configured learner.sync_bucket_mb; 0: skip them)")
    p.add_argument("--engine-buckets", type=int, default=32, help="buckets of the out-of-process rows")
    p.add_argument("--skip-in-process", action="store_true", help="only the out-of-process rows")
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # DeepSpeed's CPU accelerator JIT-builds a small op: share the cache the tests use.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                          os.path.join(sys.prefix, "torch_extensions"))

    import torch.multiprocessing as mp

    cfg = llama_config(args.params)
    shapes = named_shapes(cfg)
    n = sum(torch.Size(s).numel() for _, s in shapes)
    print(f"model: Llama, {cfg.num_hidden_layers} layers, {n / 1e6:.1f}M parameters, "
          f"{len(shapes)} tensors; {args.learners} ZeRO-3 learner(s) -> {args.receivers} "
          f"receiver(s), {args.backend}, wire {args.wire_dtype}; medians of {args.repeats}")
    print("| bucket MiB | buckets | GB     | sync s | sync GB/s | raw s  | raw GB/s | ratio "
          "| gather+pack s | wait s | bit-exact |")
    print("|-----------:|--------:|-------:|-------:|----------:|-------:|---------:|------:"
          "|--------------:|-------:|----------:|")
    sys.stdout.flush()
    t0 = time.time()
    if not args.skip_in_process:
        mp.spawn(_worker, args=(args, free_ports(3), shapes, cfg),
                 nprocs=args.learners + args.receivers, join=True)
    print(f"(ratio = raw s / sync s; gather+pack = learner 0's time in ZeRO-3 gathers and packing, "
          f"wait = its time blocked on broadcasts; bit-exact = every receiver's last version equals "
          f"the learners' GatheredParameters view; {time.time() - t0:.0f} s in all)")
    from bench_weight_sync_engine import engine_process_rows

    for mb in args.engine_bucket_mb:
        if mb:
            engine_process_rows(args, mb)
    print(analytic_70b())


if __name__ == "__main__":
    main()
