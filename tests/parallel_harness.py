"""What tests/test_sequence_parallel.py and tests/test_tensor_parallel.py share: the batch, the
real Learner built for one parallel layout, one captured train step, the 1-rank reference spawned
beside the 2-rank run, and the equality both layouts must meet (issue 25)."""
from __future__ import annotations

import concurrent.futures
import glob
import os
import types

import numpy as np
import torch
from conftest import spawn_ranks

from hpc_tba.comm.groups import free_ports
from hpc_tba.config.topology import Topology

G, K = 3, 3
OBJECTIVES = {"tb": {}, "topr": {}, "grpo": {"kl_coef": 0.04}, "alol": {}}
CLIP = 0.02


def model_path() -> str:
    return sorted(p for p in glob.glob(os.path.expanduser("~/.cache/hpc_tba/models/tiny-llama-*"))
                  if not p.endswith(".lock"))[0]


def batch(seed: int = 11):
    """9 sequences in 3 groups: prompt + response lengths 9, 6, 13 | 8, 13, 10 | 10, 11, 10 (odd
    and even, groups of different lengths), micro-batches of 2 that split groups; a micro-batch of
    the last group predicts tokens only from positions >= 8, i.e. on SP rank 1 only."""
    from hpc_tba.comm.messages import SampledBatch

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 21, n).astype(np.int32) for n in (4, 7, 9)]
    responses = [rng.integers(3, 21, n).astype(np.int32) for n in (5, 2, 9, 1, 6, 3, 1, 2, 1)]
    return SampledBatch(
        prompt_ids=np.repeat(np.arange(G), K).astype(np.int64), group_ids=np.repeat(np.arange(G), K),
        prompt_tokens=[prompts[i // K] for i in range(G * K)], response_tokens=responses,
        rewards=np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], np.float32),
        logp_behavior=[rng.normal(-3, 0.3, len(r)).astype(np.float32) for r in responses],
        policy_versions=np.zeros(G * K, dtype=np.int64))


def build_learner(rank: int, world: int, name: str, run_dir: str, *, sp: int = 1, tp: int = 1,
                  **extra):
    """The real Learner (ZeRO-3, fp32, clipping at CLIP) on `world` ranks for objective `name`."""
    from hpc_tba.buffer import BufferShard
    from hpc_tba.config import BufferConfig, LearnerConfig
    from hpc_tba.losses import make_config
    from hpc_tba.roles.learner import Learner

    cfg = LearnerConfig(total_steps=2, prompts_per_step=G, micro_batch_size=2, lr=1e-3, warmup_steps=1,
                        logprob_chunk_tokens=3, grad_clip=CLIP, sync_wire_dtype="fp32",
                        sequence_parallel_size=sp, tensor_parallel_size=tp, **extra)
    return Learner(cfg=cfg, loss=make_config(name=name, **OBJECTIVES[name]),
                   shard=BufferShard(BufferConfig(), directory=None), k=K, temperature=0.7,
                   model_path=model_path(), transport=types.SimpleNamespace(rank=rank),
                   topo=Topology.build(world, world, 0, needs_searchers=False, sp_size=sp,
                                       learner_tp_size=tp),
                   sync_group=None, run_dir=run_dir)


def captured_step(learner, data, *, full_grad, gathered) -> dict:
    """One train_step on `data` (given to the replica's leader): the log-probs, the whole gradient
    before the update (`full_grad(p)`; the clipping acts after it), the loss metric and the whole
    weights after it (read inside `gathered(params)`)."""
    from hpc_tba.roles import train_step as learner_mod  # the module that calls microbatch.accumulate

    seen, step, accumulate = {}, learner.engine.step, learner_mod.microbatch.accumulate

    def capture(*a, **kw):
        seen["grad"] = torch.cat([full_grad(p).flatten() for p in learner.engine.module.parameters()])
        group = learner.engine.optimizer.param_groups[0]  # what this step's AdamW uses
        seen["adam"] = {"lr": float(group["lr"]), "eps": float(group["eps"]), "betas": tuple(group["betas"])}
        return step(*a, **kw)

    def record(*a, **kw):
        loss, metrics, logp = accumulate(*a, **kw)
        seen["logp"] = logp.detach().clone()
        return loss, metrics, logp

    learner.engine.step = capture
    learner_mod.microbatch.accumulate = record
    try:
        metrics = learner.train_step(data if learner.peers.is_leader else None)
    finally:
        learner_mod.microbatch.accumulate = accumulate
        learner.engine.step = step
    params = list(learner.engine.module.parameters())
    with gathered(params):
        weights = torch.cat([p.detach().flatten().clone() for p in params])
    return {"logp": seen["logp"], "grad": seen["grad"], "weights": weights, "loss": metrics["loss/total"],
            "adam": seen["adam"]}


def one_and_two_ranks(tmp, worker, *, timeout_s: float) -> dict:
    """`worker(rank, world, port, path)` on 1 rank and on 2, side by side; rank 0 of each saves its
    results to `path` (tensors: a file, not spawn_ranks' return value); {world: results}."""
    ports = free_ports(2)
    for world in (1, 2):
        (tmp / f"w{world}").mkdir()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(spawn_ranks, worker, world, (world, ports[world - 1], str(tmp / f"w{world}" / "out.pt")),
                            timeout_s=timeout_s) for world in (1, 2)]
        for job in jobs:
            job.result()
    return {w: torch.load(tmp / f"w{w}" / "out.pt") for w in (1, 2)}


def assert_equals_one_rank(one: dict, two: dict) -> None:
    """Log-probs, loss and the whole gradient equal one rank's to 1e-5; the post-step weights too,
    plus what the two gradients' own difference gives through Adam's first step."""
    assert one["grad"].norm() > CLIP, "vacuous: gradient clipping never acts"
    assert (one["logp"] != 0).sum() == sum(len(r) for r in batch().response_tokens)
    torch.testing.assert_close(two["logp"], one["logp"], rtol=1e-5, atol=1e-5)
    assert abs(two["loss"] - one["loss"]) <= 1e-5 * max(1.0, abs(one["loss"]))
    scale = float(one["grad"].abs().max())  # TB's gradient reaches ~1e3: 1e-5 of the largest entry
    assert two["grad"].shape == one["grad"].shape
    assert float((two["grad"] - one["grad"]).abs().max()) <= 1e-5 * max(1.0, scale)
    assert two["adam"] == one["adam"] == {"lr": 1e-3, "eps": 1e-8, "betas": (0.9, 0.999)}  # the config's, read back
    # Adam's first step moves each entry by lr * u(clipped g), u(g) = g / (|g| + eps): where a clipped
    # gradient is near eps (seen: 2e-9) the rounding the gradient check allows moves u by ~1e-2, so the
    # weights agree to 1e-5 plus exactly what the two layouts' own gradients give through u
    lr, eps = one["adam"]["lr"], one["adam"]["eps"]

    def update(g):
        g = g * min(1.0, CLIP / (float(g.norm()) + 1e-6))  # DeepSpeed's clip factor
        return g / (g.abs() + eps)

    tol = 1e-5 * (1 + one["weights"].abs()) + lr * (update(two["grad"]) - update(one["grad"])).abs()
    diff = (two["weights"] - one["weights"]).abs()
    worst = int((diff - tol).argmax())
    assert bool((diff <= tol).all()), (f"weights differ by {float(diff[worst]):.3g} at {worst} "
                                       f"(allowed {float(tol[worst]):.3g})")
