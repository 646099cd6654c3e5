"""Replay-buffer throughput and memory: inserts/s, samples/s, resident bytes per raw token byte.

    python tools/bench_buffer.py                 # in memory, 64-token responses
    python tools/bench_buffer.py --durable       # plus segment files (fsync every second)

Trajectories are generated before timing, so only the buffer is measured. "Insert+sample" is the
rate at which trajectories can go through the buffer when each is inserted once and sampled once:
1 / (1/inserts_per_s + 1/samples_per_s); the same rate per CPU-second of this process is printed
too, since wall-clock figures on a shared machine move with its load. Resident bytes count the
buffer's allocated arrays (capacity, not just the used part) and per-prompt entries; "raw" counts
the per-token payload a searcher sends (token id + behaviour log-prob, 8 bytes a token; 12 with
reference log-probs).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpc_tba.buffer import BufferShard
from hpc_tba.comm.messages import TrajectoryBatch
from hpc_tba.config import BufferConfig


def make_batches(n_batches: int, n: int, length: int, prompts: int, *, seed: int = 0) -> list[TrajectoryBatch]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_batches):
        toks = rng.integers(0, 32000, n * length, dtype=np.int32)
        logp = -rng.random(n * length, dtype=np.float32)
        out.append(TrajectoryBatch(
            prompt_id=i % prompts, prompt_tokens=np.arange(32, dtype=np.int32), response_tokens=toks,
            lengths=np.full(n, length, dtype=np.int32), rewards=rng.random(n, dtype=np.float32),
            logp_behavior=logp, policy_version=i // 100, searcher_id=0, timestamp=time.time()))
    return out


def bench(args: argparse.Namespace, directory: str | None) -> dict[str, float]:
    cfg = BufferConfig(sampler=args.sampler, warm_start=0, capacity=args.capacity,
                       eviction=args.eviction,
                       per_prompt_capacity=100, recency_m=0.5, inv_temp=1.0, fsync="interval")
    rounds = [make_batches(args.batches, args.responses, args.length, args.prompts,
                           seed=r) for r in range(args.repeat)]
    shard = BufferShard(cfg, directory=directory)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, c0 = time.perf_counter(), time.process_time()
    for rep, batches in enumerate(rounds):
        for i, b in enumerate(batches):
            shard.add(b)
            if i % 100 == 99:  # a weight sync every 100 messages
                shard.mark_sync(rep * args.batches + i)
    t_insert, c_insert = time.perf_counter() - t0, time.process_time() - c0
    inserted = args.repeat * args.batches * args.responses
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(args.samples):
        shard.sample(args.groups, args.k, learner_version=s)
    t_sample, c_sample = time.perf_counter() - t0, time.process_time() - c0
    sampled = args.samples * args.groups * args.k
    st = shard.store
    live_tokens = int(st.s["len"][st.live_slots()].sum())
    raw_per_token = 8  # int32 token + float32 behaviour log-prob
    m = shard.metrics()
    shard.close()
    ins, smp = inserted / t_insert, sampled / t_sample
    cpu = 1 / (c_insert / inserted + c_sample / sampled)
    return {"inserts_per_s": ins, "samples_per_s": smp, "insert_plus_sample_per_s": 1 / (1 / ins + 1 / smp),
            "insert_plus_sample_per_cpu_s": cpu,
            "stored": len(shard), "resident_over_raw": st.resident_bytes() / (live_tokens * raw_per_token),
            "resident_over_token_ids": st.resident_bytes() / (live_tokens * 4),
            "maxrss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
            "log_mib": m.get("buffer/log_bytes", 0) / 2**20, "compactions": m.get("buffer/compactions", 0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=64, help="tokens per response")
    p.add_argument("--responses", type=int, default=24, help="responses per searcher message (S)")
    p.add_argument("--batches", type=int, default=8000, help="distinct messages inserted per repeat")
    p.add_argument("--repeat", type=int, default=1, help="rounds; each round inserts fresh messages")
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--capacity", type=int, default=100_000, help="global cap (0 = unbounded)")
    p.add_argument("--samples", type=int, default=2000, help="sample() calls timed")
    p.add_argument("--groups", type=int, default=7, help="prompts per batch (G)")
    p.add_argument("--k", type=int, default=20, help="responses per prompt (K)")
    p.add_argument("--sampler", default="tba")
    p.add_argument("--eviction", default="oldest", help="oldest or lowest_reward")
    p.add_argument("--durable", action="store_true", help="also log to segment files (tmpdir)")
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="bench_buffer_")  # segments removed at exit
    modes = [("memory", None)] + ([("durable", tmp.name)] if args.durable else [])
    print(f"{args.length}-token responses, {args.responses}/message, G={args.groups} K={args.k}, "
          f"sampler={args.sampler}, capacity={args.capacity}, eviction={args.eviction}")
    for name, directory in modes:
        r = bench(args, directory)
        print(f"[{name}] inserts/s {r['inserts_per_s']:,.0f}  samples/s {r['samples_per_s']:,.0f}  "
              f"insert+sample/s {r['insert_plus_sample_per_s']:,.0f} "
              f"(per CPU-second {r['insert_plus_sample_per_cpu_s']:,.0f})  stored {r['stored']:,}  "
              f"resident/raw {r['resident_over_raw']:.2f}x  (/token ids only "
              f"{r['resident_over_token_ids']:.2f}x)  maxrss +{r['maxrss_growth_mib']:.0f} MiB  "
              f"log {r['log_mib']:.0f} MiB  compactions {r['compactions']:.0f}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
