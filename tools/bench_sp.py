"""Benchmark: Ulysses sequence parallelism against data parallelism on the same 2 learner ranks (issue 25).

    DS_ACCELERATOR=cpu python tools/bench_sp.py [--size 10m] [--k 4] [--algo tb] [--steps 1]
        [--checkpointing]

The learner's long-response path: K sequences of 4x the default prompt + response (4 x (256 +
512) = 3072 tokens), one Llama-shaped model of tools/bench_learner.py's sizes (random weights,
built locally), on 2 ranks either way, so ZeRO-3 shards the model states alike:
- SP1: two data-parallel ranks, each training its own batch of K sequences;
- SP2: `learner.sequence_parallel_size=2`, both ranks splitting one batch's sequences.
Each rank is the real Learner (built from the composed config) in a fresh process. Peak memory
per rank is measured as bench_learner measures it (VmHWM after the model is built, less the
resident memory before; glibc's mmap threshold fixed, `--mmap-threshold`), and the larger of the
two ranks counts. tokens/s: both ranks' tokens of one step over its seconds.

Last lines (3 significant digits): `peak SP2/SP1 at 4x length` (goal <= 0.6: an SP rank holds
half of each sequence's activations) and `tokens/s SP2/SP1`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_learner import PROMPT, RESPONSE, SIZES, _rss, add_measure_options, build_model, fmt, make_batch  # noqa: E402

SP_LENGTH = 4  # the SP figures run sequences 4x the default prompt + response


def child(args: dict) -> dict:
    """One rank of a 2-rank measurement (this fresh process): the real Learner with
    learner.sequence_parallel_size=args['sp'] (1: two data-parallel ranks, each its own batch; 2:
    both ranks split one batch's sequences), K sequences of SP_LENGTH x (prompt + response)."""
    import types

    import torch

    torch.set_num_threads(args["threads"])
    import deepspeed

    from hpc_tba.assembly.compose import compose
    from hpc_tba.buffer import BufferShard
    from hpc_tba.config import resolve_wire_dtype
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.learner import Learner

    rank, sp, k = args["rank"], args["sp"], args["k"]
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args["port"]))
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, rank=rank, world_size=2,
                               init_method=f"tcp://127.0.0.1:{args['port']}", verbose=False)
    prompt_len, resp_len = SP_LENGTH * PROMPT, SP_LENGTH * RESPONSE
    cfg = compose([f"model.path={args['path']}", f"algo={args['algo']}", f"searcher.k={k}",
                   "learner.prompts_per_step=1", f"learner.micro_batch_size={args['micro']}",
                   f"learner.gradient_checkpointing={args['checkpointing']}",
                   f"searcher.max_model_len={prompt_len + resp_len}", f"searcher.max_new_tokens={resp_len}",
                   "learner.dtype=fp32", "cluster.num_learners=2", "cluster.num_searchers=0",
                   f"learner.sequence_parallel_size={sp}"])
    # SP peers share one batch, DP ranks do not
    batch = make_batch(SIZES[args["size"]][0], k, rank if sp == 1 else 0, prompt_len=prompt_len, resp_len=resp_len)
    import transformers.models.llama.modeling_llama  # noqa: F401

    base = _rss("VmRSS")
    with tempfile.TemporaryDirectory() as run_dir:
        lr = dataclasses.replace(cfg.learner, sync_wire_dtype=resolve_wire_dtype(cfg.learner, cfg.searcher))
        learner = Learner(cfg=lr, loss=cfg.algo, shard=BufferShard(cfg.buffer, directory=None), k=k,
                          temperature=cfg.searcher.temperature, model_path=args["path"],
                          transport=types.SimpleNamespace(rank=rank),
                          topo=Topology.build(2, 2, 0, needs_searchers=False, sp_size=sp), sync_group=None,
                          run_dir=os.path.join(run_dir, str(rank)))
        mine = batch if sp == 1 or rank == 0 else None
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        learner.train_step(mine)  # warm-up: Adam's states
        t0 = time.perf_counter()
        for _ in range(max(args["steps"], 1)):
            learner.train_step(mine)
        dt = (time.perf_counter() - t0) / max(args["steps"], 1)
    tokens = k * (prompt_len + resp_len) * (2 if sp == 1 else 1)  # both ranks together
    return {"tokens_per_s": tokens / dt, "peak": _rss("VmHWM") - base}


def measure_sp(path: str, size: str, a, *, sp: int) -> dict:
    """Both ranks of a 2-rank SP (or DP) measurement; the larger peak of the two."""
    from hpc_tba.comm.groups import free_ports

    port = free_ports(1)[0]
    path_env = os.pathsep.join(filter(None, [sys.path[0], os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HPC_TBA_NO_PROGRESS="1", PYTHONPATH=path_env)
    if a.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(dict(
        rank=r, sp=sp, port=port, path=path, size=size, k=a.k, micro=a.k, algo=a.algo,
        checkpointing=a.checkpointing, steps=a.steps, threads=1))], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=a.timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"SP {sp} failed:\n{err[-3000:]}")
    res = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    return {"tokens_per_s": res[0]["tokens_per_s"], "peak": max(r["peak"] for r in res)}


def sequence_parallel_figures(a) -> None:
    """`peak SP2/SP1 at 4x length` and `tokens/s SP2/SP1`: 2 ranks either way (the same ZeRO-3
    sharding of the model states), SP 1 = each rank trains its own batch, SP 2 = both split one."""
    size = a.size
    path = build_model(size)
    sp1, sp2 = (measure_sp(path, size, a, sp=sp) for sp in (1, 2))
    print(f"  {size:>5}: {SP_LENGTH * (PROMPT + RESPONSE)}-token sequences, K={a.k}, 2 ranks: SP1 (DP) "
          f"{sp1['tokens_per_s']:.1f} tok/s peak {sp1['peak'] / 2**30:.2f} GiB | SP2 {sp2['tokens_per_s']:.1f} "
          f"tok/s peak {sp2['peak'] / 2**30:.2f} GiB", flush=True)
    print(f"peak SP2/SP1 at 4x length = {fmt(sp2['peak'] / sp1['peak'])}")
    print(f"tokens/s SP2/SP1 = {fmt(sp2['tokens_per_s'] / sp1['tokens_per_s'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10m", choices=list(SIZES))
    ap.add_argument("--k", type=int, default=4, help="sequences per step (one prompt group)")
    ap.add_argument("--algo", default="tb")
    add_measure_options(ap)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))), flush=True)
        return 0
    print(f"bench_sp: {a.size} model, {a.algo}, K={a.k}, checkpointing {a.checkpointing}, 2 ranks, "
          f"1 thread each, mmap threshold {a.mmap_threshold or 'glibc default'}", flush=True)
    sequence_parallel_figures(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
