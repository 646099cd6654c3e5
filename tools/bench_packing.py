"""Benchmark: packed token-budget micro-batches against padded rows on 2 learner ranks (issue 43).

    DS_ACCELERATOR=cpu python tools/bench_packing.py [--size 10m] [--groups 2] [--k 4]
        [--max-response 512] [--spread 16] [--steps 2]

One step's batch spread like RL's: G prompt groups of K responses whose lengths are log-uniform
over `--spread`x (max-response / spread .. max-response tokens), after a prompt of 64 tokens; a
Llama-shaped model of tools/bench_learner.py's sizes (random weights, built locally), the same
objective. On 2 ZeRO-3 gloo ranks, each the real Learner in a fresh process with its own batch:
- padded: `learner.micro_batch_size=M` rows, each padded to its micro-batch's longest sequence
  (sorted by length, as the learner does);
- packed: `learner.micro_batch_tokens=M x (prompt + max-response)`, the same most tokens a forward
  may compute, bin-packed several sequences to a row (rows as long as a bin's longest).
Both learners start from the same weights; their first step's loss is compared (fp32), then each
is timed over `--steps` steps on its batch, alternating A B A B in each rank. tokens/s counts the
batch's real tokens (prompt + response), both ranks together.

Last lines (3 significant digits): `packed/padded tokens/s` (goal >= 1.5) and `packed/padded
loss max abs diff` (goal <= 1e-5).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_learner import SIZES, build_model, fmt  # noqa: E402

PROMPT_LEN = 64


def make_batch(vocab: int, groups: int, k: int, max_response: int, spread: float, seed: int):
    """G groups of K responses, lengths log-uniform over [max_response / spread, max_response]."""
    import numpy as np

    from hpc_tba.comm.messages import SampledBatch

    rng = np.random.default_rng(seed)
    n = groups * k
    low = max(1.0, max_response / spread)
    lengths = np.exp(rng.uniform(np.log(low), np.log(max_response), n)).round().astype(int)
    prompts = [rng.integers(3, vocab, PROMPT_LEN).astype(np.int32) for _ in range(groups)]
    responses = [rng.integers(3, vocab, int(m)).astype(np.int32) for m in lengths]
    return SampledBatch(
        prompt_ids=np.repeat(np.arange(groups), k).astype(np.int64), group_ids=np.repeat(np.arange(groups), k),
        prompt_tokens=[prompts[i // k] for i in range(n)], response_tokens=responses,
        rewards=rng.random(n).astype(np.float32),
        logp_behavior=[rng.normal(-3, 0.3, len(r)).astype(np.float32) for r in responses],
        policy_versions=np.zeros(n, dtype=np.int64))


def child(args: dict) -> dict:
    """One rank: the padded and the packed Learner from the same weights, the first step's loss of
    each, then both timed alternately on this rank's batch."""
    import dataclasses
    import types

    import torch

    torch.set_num_threads(1)
    import deepspeed

    from hpc_tba.assembly.compose import compose
    from hpc_tba.buffer import BufferShard
    from hpc_tba.config import resolve_wire_dtype
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.learner import Learner

    rank, k, micro = args["rank"], args["k"], args["micro"]
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args["port"]))
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, rank=rank, world_size=2,
                               init_method=f"tcp://127.0.0.1:{args['port']}", verbose=False)
    max_len = PROMPT_LEN + args["max_response"]
    batch = make_batch(SIZES[args["size"]][0], args["groups"], k, args["max_response"], args["spread"], seed=rank)
    learners = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for name, budget in (("padded", 0), ("packed", micro * max_len)):
            cfg = compose([f"model.path={args['path']}", f"algo={args['algo']}", f"searcher.k={k}",
                           f"learner.prompts_per_step={args['groups']}", f"learner.micro_batch_size={micro}",
                           f"learner.micro_batch_tokens={budget}", f"searcher.max_model_len={max_len}",
                           f"searcher.max_new_tokens={args['max_response']}", "learner.dtype=fp32",
                           "cluster.num_learners=2", "cluster.num_searchers=0"])
            lr = dataclasses.replace(cfg.learner, sync_wire_dtype=resolve_wire_dtype(cfg.learner, cfg.searcher))
            learners[name] = Learner(cfg=lr, loss=cfg.algo, shard=BufferShard(cfg.buffer, directory=None), k=k,
                                     temperature=cfg.searcher.temperature, model_path=args["path"],
                                     transport=types.SimpleNamespace(rank=rank),
                                     topo=Topology.build(2, 2, 0, needs_searchers=False), sync_group=None,
                                     run_dir=os.path.join(run_dir, name, str(rank)))
        out = {name: {"loss": learner.train_step(batch)["loss/total"], "s": 0.0,
                      "micro_batches": 0.0} for name, learner in learners.items()}  # the first step: same weights
        for _ in range(max(args["steps"], 1)):
            for name, learner in learners.items():
                t0 = time.perf_counter()
                m = learner.train_step(batch)
                out[name]["s"] += time.perf_counter() - t0
                out[name]["micro_batches"] = m["train/micro_batches"]
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_tokens, batch.response_tokens))
    padded = sum(padded_positions(batch, rows) for rows in padded_rows(batch, micro))
    return {"tokens": tokens, "padded_positions": padded, **out}


def padded_rows(batch, micro: int):
    import numpy as np

    from hpc_tba.roles import microbatch

    lengths = np.array([len(p) + len(r) for p, r in zip(batch.prompt_tokens, batch.response_tokens)])
    return microbatch.plan(lengths, batch.group_ids, micro).rows


def padded_positions(batch, rows) -> int:
    """Token positions the padded micro-batch `rows` computes: rows x its longest sequence."""
    return len(rows) * max(len(batch.prompt_tokens[i]) + len(batch.response_tokens[i]) for i in rows)


def measure(path: str, a) -> list[dict]:
    from hpc_tba.comm.groups import free_ports

    port = free_ports(1)[0]
    path_env = os.pathsep.join(filter(None, [sys.path[0], os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HPC_TBA_NO_PROGRESS="1", PYTHONPATH=path_env)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(dict(
        rank=r, port=port, path=path, size=a.size, groups=a.groups, k=a.k, micro=a.micro, algo=a.algo,
        max_response=a.max_response, spread=a.spread, steps=a.steps))], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=a.timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"bench_packing rank failed:\n{err[-3000:]}")
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10m", choices=list(SIZES))
    ap.add_argument("--groups", type=int, default=2, help="prompt groups per rank and step (G)")
    ap.add_argument("--k", type=int, default=4, help="responses per prompt (K)")
    ap.add_argument("--micro", type=int, default=4, help="padded: sequences per micro-batch; packed: "
                    "the budget is this many longest sequences' tokens")
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--spread", type=float, default=16.0, help="longest / shortest response")
    ap.add_argument("--algo", default="tb")
    ap.add_argument("--steps", type=int, default=2, help="timed steps of each, after the compared first step")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        return 0
    print(f"bench_packing: {a.size} model, {a.algo}, G={a.groups} x K={a.k} per rank, responses "
          f"{a.max_response / a.spread:.0f}-{a.max_response} tokens (log-uniform) after {PROMPT_LEN}, "
          f"micro {a.micro} sequences vs {a.micro * (PROMPT_LEN + a.max_response)} tokens, 2 ranks", flush=True)
    ranks = measure(build_model(a.size), a)
    tokens = sum(r["tokens"] for r in ranks)
    rate = {name: tokens * max(a.steps, 1) / max(r[name]["s"] for r in ranks) for name in ("padded", "packed")}
    for name in ("padded", "packed"):
        print(f"  {name:>6}: {rate[name]:.1f} real tok/s, {ranks[0][name]['micro_batches']:.0f} micro-batches "
              f"on rank 0, first-step loss {ranks[0][name]['loss']:.6g}", flush=True)
    pad = sum(r["padded_positions"] for r in ranks)
    print(f"  real tokens {tokens}, padded positions {pad} ({100 * (1 - tokens / pad):.0f}% padding)")
    print(f"packed/padded tokens/s = {fmt(rate['packed'] / rate['padded'])}")
    diff = max(abs(r["packed"]["loss"] - r["padded"]["loss"]) for r in ranks)
    print(f"packed/padded loss max abs diff = {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
