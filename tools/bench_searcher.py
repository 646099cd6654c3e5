"""Benchmark: tokens/s through the searcher's round against bare vLLM `generate`.

    python tools/bench_searcher.py [--rounds 40] [--warmup 3]

One vLLM engine (the embedded tiny model, default `searcher` config) serves both paths, in one
process, on the same prompts and sampling parameters, alternating round by round so that a
noisy machine slows both alike:

- searcher: `Searcher.generate_round()` - pick prompts, generate S samples each with per-token
  log-probs, decode, score with the task's reward, pack every prompt's samples into a
  `TrajectoryBatch` buffer and hand it to the transport (a stand-in that keeps the packed bytes
  instead of calling MPI `Isend`; packing is what the MPI transport does before it sends);
- bare: `LLM.generate` on the prompts that searcher round used, with the SamplingParams the
  engine builds (n = S, temperature, max_tokens, logprobs=0), and nothing else.

tokens/s = generated tokens / wall time of the round; the ratio is searcher / bare (goal >= 0.9).
Weight application between rounds is excluded (no receiver): it is measured by
bench_weight_sync.py and the `searcher/weight_apply_s` metric.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RecordingTransport:
    """Stand-in for a Transport (comm.transport): keeps packed trajectories instead of sending them."""

    def __init__(self) -> None:
        self.rank = 1
        self.sent_to: dict[int, int] = {}
        self.messages: list[tuple[int, np.ndarray]] = []  # (dest, packed TrajectoryBatch bytes)

    def send(self, dest: int, message) -> None:
        from hpc_tba.comm.messages import TrajectoryBatch

        if isinstance(message, TrajectoryBatch):  # control messages are not benchmarked
            self.messages.append((dest, message.pack()))
            self.sent_to[dest] = self.sent_to.get(dest, 0) + 1

    def progress(self) -> int:
        return 0

    def flush(self) -> None:
        pass

    def poll(self, tag, **_):
        return []


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40, help="timed rounds of each path")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds of each path first")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from hpc_tba.comm.messages import TrajectoryBatch
    from hpc_tba.config import ModelConfig, SearcherConfig, TaskConfig
    from hpc_tba.config.topology import Topology
    from hpc_tba.engine.vllm_engine import VLLMEngine, configure_cpu_env
    from hpc_tba.tasks import build_task
    from hpc_tba.tasks.embedded import resolve_model_path

    cfg, task_cfg = SearcherConfig(), TaskConfig()
    path = resolve_model_path(ModelConfig(), task_cfg)
    configure_cpu_env(core=None, kv_cache_mb=cfg.kv_cache_mb)
    from vllm import SamplingParams

    from hpc_tba.roles.searcher import Searcher

    engine = VLLMEngine(path, cfg, seed=cfg.seed)
    transport = RecordingTransport()
    with tempfile.TemporaryDirectory() as run_dir:
        searcher = Searcher(cfg=cfg, task=build_task(task_cfg), engine=engine, receiver=None,
                            transport=transport, topo=Topology.build(2, 1, 1), index=0,
                            run_dir=run_dir)
        tokens_of = {pr.id: toks for pr, toks in zip(searcher.prompts, searcher.tokens)}
        params = SamplingParams(n=cfg.samples_per_prompt, temperature=cfg.temperature,
                                max_tokens=cfg.max_new_tokens, logprobs=0)
        rows = {"searcher": [], "bare": []}  # (tokens, seconds) per timed round
        for r in range(args.warmup + args.rounds):
            first = len(transport.messages)
            t0 = time.perf_counter()
            searcher.generate_round()
            dt = time.perf_counter() - t0
            batches = [TrajectoryBatch.unpack(b) for _, b in transport.messages[first:]]
            prompts = [{"prompt_token_ids": list(tokens_of[b.prompt_id])} for b in batches]
            t0 = time.perf_counter()
            outs = engine.llm.generate(prompts, params, use_tqdm=False)
            dt_bare = time.perf_counter() - t0
            if r >= args.warmup:
                rows["searcher"].append((sum(int(b.lengths.sum()) for b in batches), dt))
                rows["bare"].append((sum(len(c.token_ids) for o in outs for c in o.outputs), dt_bare))
        searcher.close()

    print(f"model: embedded tiny Llama ({path}); {cfg.prompts_per_round} prompts x S="
          f"{cfg.samples_per_prompt} per round, max_new_tokens={cfg.max_new_tokens}, "
          f"T={cfg.temperature}; {args.rounds} timed rounds after {args.warmup} warm-up, "
          "alternating paths")
    print("| path     | tokens | seconds | tokens/s (total) | tokens/s (median round) |")
    print("|----------|-------:|--------:|-----------------:|------------------------:|")
    rate = {}
    for name, rs in rows.items():
        tok, sec = sum(t for t, _ in rs), sum(s for _, s in rs)
        rate[name] = tok / sec
        med = statistics.median(t / s for t, s in rs)
        print(f"| {name:8} | {tok:6d} | {sec:7.2f} | {rate[name]:16.1f} | {med:23.1f} |")
    print(f"ratio searcher / bare vLLM generate: {rate['searcher'] / rate['bare']:.3f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
