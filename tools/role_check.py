"""The learner role driven for real, on whatever device the machine has (tools/gpu_check.sh, tests).

    mpiexec -n 2 python tools/role_check.py --recording traj.npz --out DIR [hydra overrides...]
    python tools/role_check.py --record traj.npz        # write a recording (one process)

Rank 0 is the real Learner, built by hpc_tba.assembly.build from a composed config (DeepSpeed
ZeRO-3 on the accelerator, NCCL groups on a GPU, gloo on CPU). Rank 1 stands in for a
searcher: it replays recorded trajectories over the real MPI transport, then receives the
weights through the real WeightReceiver. The learner takes them into its shard, runs
Learner.train_step twice (micro-batched), syncs through its WeightSender, checks the weights
the replayer received against its own gathered ones, checkpoints and exports, and writes
DIR/role_check.json. Exits non-zero on any failed check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

PROMPTS, RESPONSES = 6, 5


def record(path: str, *, vocab: int = 21, seed: int = 0) -> None:
    """A recording of PROMPTS trajectories (RESPONSES responses each) with the tiny vocabulary."""
    rng = np.random.default_rng(seed)
    out = {}
    for p in range(PROMPTS):
        lengths = rng.integers(1, 9, RESPONSES).astype(np.int32)
        out[f"{p}/prompt"] = rng.integers(3, vocab, rng.integers(3, 10)).astype(np.int32)
        out[f"{p}/response"] = rng.integers(3, vocab, int(lengths.sum())).astype(np.int32)
        out[f"{p}/lengths"] = lengths
        out[f"{p}/rewards"] = rng.integers(0, 2, RESPONSES).astype(np.float32)
        out[f"{p}/logp"] = rng.normal(-3.0, 0.3, int(lengths.sum())).astype(np.float32)
    np.savez(path, **out)


def replay(path: str):
    from hpc_tba.comm.messages import TrajectoryBatch

    rec = np.load(path)
    for p in range(len({k.split("/")[0] for k in rec.files})):
        yield TrajectoryBatch(prompt_id=p, prompt_tokens=rec[f"{p}/prompt"], response_tokens=rec[f"{p}/response"],
                              lengths=rec[f"{p}/lengths"], rewards=rec[f"{p}/rewards"],
                              logp_behavior=rec[f"{p}/logp"], policy_version=0, searcher_id=0,
                              timestamp=time.time())


def weight_sums(module) -> list[float]:
    """fp64 sum of every parameter, gathered (ZeRO-3) one at a time."""
    import deepspeed

    sums = []
    for p in module.parameters():
        with deepspeed.zero.GatheredParameters([p]):
            sums.append(float(p.detach().double().sum()))
    return sums


def learner_side(cfg, transport, topo, groups, out_dir: str) -> dict:
    import torch

    from hpc_tba.assembly.build import build_learner
    from hpc_tba.checkpoint import store as checkpoint
    from hpc_tba.tasks.embedded import resolve_model_path

    learner = build_learner(cfg, transport, topo, groups, resolve_model_path(cfg.model, cfg.task), None)
    n_traj = transport.bcast_json(None, root=1)["sent"]
    while sum(learner.received.values()) < n_traj:
        learner.receive()
        time.sleep(0.01)
    losses = [learner.train_step()["loss/total"] for _ in range(2)]
    learner.step = 2
    learner.sync(evaluate=False)
    mine = weight_sums(learner.engine.module)
    theirs = transport.bcast_json(None, root=1)["sums"]
    ckpt = learner.save_checkpoint()
    export = os.path.join(out_dir, "export")
    checkpoint.export_hf(learner.engine, export, tokenizer_src=learner.model_path, learner_rank=learner.lrank)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    exp_sums = [float(p.detach().double().sum()) for p in exported.parameters()]
    learner.sender.stop()
    learner.close()
    close = bool(np.allclose(mine, theirs, rtol=1e-5, atol=1e-4))
    return {"device": str(learner.device), "backend": groups.backend, "losses": losses,
            "finite": bool(np.all(np.isfinite(losses))), "received": sum(learner.received.values()),
            "weights_match": close, "export_matches": bool(np.allclose(mine, exp_sums, rtol=1e-5, atol=1e-4)),
            "checkpoint": os.path.isdir(ckpt), "sync_bytes": learner.manifest.total_bytes}


def replay_side(cfg, transport, groups, recording: str) -> None:
    from hpc_tba.comm.weight_sync import Manifest, WeightReceiver

    setup = transport.bcast_json(None)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    receiver = WeightReceiver(Manifest.from_json(setup["manifest"]), groups.sync_group, device=device)
    n = 0
    for batch in replay(recording):
        transport.send(0, batch)
        n += 1
    transport.flush()
    transport.bcast_json({"sent": n}, root=1)
    if not receiver.wait_for(2, timeout=600):
        raise RuntimeError("role_check: weights of version 2 never arrived")
    staged, _ = receiver.take()
    sums = [float(t.double().sum()) for _, t in staged.tensors]
    transport.bcast_json({"sums": sums}, root=1)
    receiver.join(timeout=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", help="write a recording here and exit")
    ap.add_argument("--recording", help="trajectories to replay (from --record)")
    ap.add_argument("--out", help="directory for the run, the export and role_check.json")
    args, overrides = ap.parse_known_args(argv)
    if args.record:
        record(args.record)
        return 0
    if not (args.recording and args.out):
        ap.error("--recording and --out are required (or --record)")
    from hpc_tba.assembly.compose import compose
    from hpc_tba.assembly.rank import setup_rank
    from hpc_tba.comm.groups import setup_groups

    cfg = compose(["cluster.num_learners=1", "cluster.num_searchers=1", f"run_dir={args.out}/run",
                   "learner.prompts_per_step=2", f"searcher.k={RESPONSES - 1}", "learner.micro_batch_size=3",
                   "buffer.warm_start=1", *overrides])
    rank = setup_rank(cfg)
    transport, topo = rank.transport, rank.topology
    import torch

    # One GPU: learner and replayer share it, and NCCL refuses two ranks on one GPU.
    one_gpu = torch.cuda.is_available() and torch.cuda.device_count() < 2
    groups = setup_groups(transport, topo, backend=cfg.cluster.dist_backend,
                          sync_backend="gloo" if one_gpu else None)
    if transport.rank == 0:
        report = learner_side(cfg, transport, topo, groups, args.out)
        with open(os.path.join(args.out, "role_check.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps(report), flush=True)
        ok = report["finite"] and report["weights_match"] and report["export_matches"] and report["checkpoint"]
        return 0 if ok else 1
    replay_side(cfg, transport, groups, args.recording)
    return 0


if __name__ == "__main__":
    sys.exit(main())
