"""The real Learner (DeepSpeed ZeRO-3 on the CPU accelerator): its step's micro-batching (with and
without gradient checkpointing) equals one big batch, and every tensor it and its WeightSender
hand to the model or to a collective is on the role's device (tests/device_audit.py makes a
device mismatch visible on CPU).
"""
from __future__ import annotations

import glob
import json
import os
import types

import numpy as np
import pytest
import torch

from hpc_tba.comm.groups import free_ports

G, K = 3, 4


def _batch():
    from hpc_tba.comm.messages import SampledBatch

    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 21, rng.integers(3, 8)).astype(np.int32) for _ in range(G)]
    responses = [rng.integers(3, 21, rng.integers(1, 10)).astype(np.int32) for _ in range(G * K)]
    return SampledBatch(
        prompt_ids=np.repeat(np.arange(G), K).astype(np.int64), group_ids=np.repeat(np.arange(G), K),
        prompt_tokens=[prompts[i // K] for i in range(G * K)], response_tokens=responses,
        rewards=rng.integers(0, 2, G * K).astype(np.float32),
        logp_behavior=[rng.normal(-3, 0.3, len(r)).astype(np.float32) for r in responses],
        policy_versions=np.zeros(G * K, dtype=np.int64))


class _Group:
    """Stands in for the sync group: records what the sender broadcasts."""

    def __init__(self, audit):
        import torch.distributed as dist

        from hpc_tba.comm.weight_sync.group import attach_store

        self.audit = audit
        attach_store(self, dist.HashStore())  # the headers go to the group's store (host side)

    def size(self):
        return 1  # the learner alone: no searcher reads the headers

    def broadcast(self, tensors, opts):
        self.audit.check("weight-sync broadcast", tensors)
        return types.SimpleNamespace(wait=lambda: None)


def _learner(tmp: str, loss: str, micro: int, **extra):
    from hpc_tba.buffer import BufferShard
    from hpc_tba.config import BufferConfig, LearnerConfig
    from hpc_tba.config.topology import Topology
    from hpc_tba.losses import make_config
    from hpc_tba.roles.learner import Learner

    model = sorted(p for p in glob.glob(os.path.expanduser("~/.cache/hpc_tba/models/tiny-llama-*"))
                   if not p.endswith(".lock"))[0]
    cfg = LearnerConfig(total_steps=2, prompts_per_step=G, micro_batch_size=micro, lr=1e-3,
                        warmup_steps=1, logprob_chunk_tokens=4, sync_wire_dtype="fp32", **extra)
    return Learner(cfg=cfg, loss=make_config(name=loss), shard=BufferShard(BufferConfig(), directory=None),
                   k=K, temperature=0.7, model_path=model, transport=types.SimpleNamespace(rank=0),
                   topo=Topology.build(1, 1, 0, needs_searchers=False), sync_group=None,
                   run_dir=os.path.join(tmp, f"run_{loss}_{micro}_{len(extra)}"))


def _grads_of_step(learner) -> np.ndarray:
    """Run one train_step; the full gradient as the optimizer is about to apply it."""
    from deepspeed.utils import safe_get_full_grad

    seen = {}
    step = learner.engine.step

    def capture(*a, **kw):
        seen["g"] = torch.cat([safe_get_full_grad(p).flatten() for p in learner.engine.module.parameters()])
        return step(*a, **kw)

    learner.engine.step = capture
    learner.train_step(_batch())
    return seen["g"].numpy().copy()


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import torch.distributed as dist
    from device_audit import DeviceAudit

    import hpc_tba.roles.learner as learner_mod

    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, rank=0, world_size=1,
                               init_method=f"tcp://127.0.0.1:{port}", verbose=False)
    report = {"grads": {}}
    for loss in ("tb", "grpo"):
        grads = {m: _grads_of_step(_learner(tmp, loss, m)) for m in (G * K, 0, 2)}
        report["grads"][loss] = {str(m): float(np.abs(g - grads[G * K]).max()) for m, g in grads.items()}
        report["grads"][loss]["scale"] = float(np.abs(grads[G * K]).max())
        ckpt_learner = _learner(tmp, loss, 2, gradient_checkpointing=True)
        calls: list[int] = []
        ckpt_learner.engine.module.model.layers[0].register_forward_pre_hook(
            lambda *a, calls=calls: calls.append(1))
        checkpointed = _grads_of_step(ckpt_learner)
        report["grads"][loss]["layer_calls"] = len(calls)
        for option in ("offload_optimizer", "offload_params"):  # DeepSpeed builds and steps with them
            g = _grads_of_step(_learner(tmp, loss, 0, **{option: True}))
            report["grads"][loss][option] = float(np.abs(g - grads[G * K]).max())
        report["grads"][loss]["checkpointed"] = float(np.abs(checkpointed - grads[G * K]).max())

    role = torch.device("cpu", 0)  # a device VALUE distinct from torch.device("cpu")
    learner_mod.role_device = lambda engine: role
    learner = _learner(tmp, "tb", 2)
    audit = DeviceAudit(role)
    learner.engine.module.register_forward_pre_hook(
        lambda m, a, kw: audit.check("model forward", a, kw), with_kwargs=True)
    learner.ref.module.register_forward_pre_hook(
        lambda m, a, kw: audit.check("reference forward", a, kw), with_kwargs=True)
    originals = {n: getattr(dist, n) for n in ("all_reduce", "broadcast", "all_gather_into_tensor")}

    def wrap(name):
        def collective(tensor, *a, **kw):
            audit.check(f"dist.{name}", tensor)
            return originals[name](tensor, *a, **kw)
        return collective

    for n in originals:
        setattr(dist, n, wrap(n))
    learner.sender.group = _Group(audit)
    # no out-of-process engine (worker_groups.EngineGroups needs a TCPStore): the sync group carries the data
    learner.sender.engines = types.SimpleNamespace(refresh=lambda: [0], all_registered=False,
                                                   groups=lambda: [], feeds=lambda: [])
    with audit:
        learner.train_step(_batch())
        learner._reduce({"a": 1.0, "b": float("nan")})
        learner.sender.send(1)
    report["violations"] = sorted(set(audit.violations))
    report["sender_device"] = str(learner.sender.device)
    (open(os.path.join(tmp, "report.json"), "w")).write(json.dumps(report))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import sys

    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("learner")
    sys.path.insert(0, os.path.dirname(__file__))  # device_audit for the spawned worker
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
    mp.spawn(_worker, args=(free_ports(1)[0], str(tmp)), nprocs=1, join=True)
    return json.loads((tmp / "report.json").read_text())


@pytest.mark.parametrize("loss", ["tb", "grpo"])
def test_micro_batched_step_has_the_one_batch_gradient(report, loss):
    g = report["grads"][loss]
    assert g["scale"] > 0
    assert g["0"] <= 1e-5 * g["scale"] and g["2"] <= 1e-5 * g["scale"], g
    assert g["checkpointed"] <= 1e-5 * g["scale"], g  # gradient checkpointing changes nothing
    # ... but it ran: each micro-batch's layer forward was recomputed in the backward pass
    # (a pre-hook: the recompute stops once it has what the backward needs): 6 micro-batches of 2,
    # each forward once more in the backward, plus tb's context pass (the 5 after the first)
    assert g["layer_calls"] == (12 if loss == "grpo" else 17), g
    assert g["offload_optimizer"] <= 1e-5 * g["scale"] and g["offload_params"] <= 1e-5 * g["scale"], g


def test_no_tensor_reaches_model_or_collective_off_the_role_device(report):
    assert report["violations"] == []
    assert report["sender_device"] == "cpu:0"
