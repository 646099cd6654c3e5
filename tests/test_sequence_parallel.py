"""Ulysses sequence parallelism is exact (issue 25): the real Learner (DeepSpeed ZeRO-3, CPU, fp32,
gradient clipping on) with learner.sequence_parallel_size=2 on 2 gloo ranks gives, for TB, TOPR,
GRPO and A-LoL, the same log-probs, loss, gradients and post-step weights as one rank (1e-5).
The batch has sequences whose lengths do not divide by 2, groups whose sequences differ in
length, and micro-batches that split groups (TB's context pass). Plus the layout (DP rank, shard
owners) and the refusals by name (SP with TP, SP not dividing the heads); TP: test_tensor_parallel.py.
"""
from __future__ import annotations

import concurrent.futures
import glob
import os
import types

import numpy as np
import pytest
import torch
from conftest import gloo_deepspeed, spawn_ranks

from hpc_tba.comm.groups import free_ports
from hpc_tba.topology import LayoutError, Topology

G, K = 3, 3
OBJECTIVES = {"tb": {}, "topr": {}, "grpo": {"kl_coef": 0.04}, "alol": {}}
CLIP = 0.02


def _model_path() -> str:
    return sorted(p for p in glob.glob(os.path.expanduser("~/.cache/hpc_tba/models/tiny-llama-*"))
                  if not p.endswith(".lock"))[0]


def _batch():
    from hpc_tba.messages import SampledBatch

    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 21, n).astype(np.int32) for n in (4, 7, 9)]
    # prompt + response: 9, 6, 13 | 8, 13, 10 (odd and even) | 10, 11, 10: a micro-batch of the
    # last group predicts tokens only from positions >= 8, i.e. on SP rank 1 only
    lengths = [5, 2, 9, 1, 6, 3, 1, 2, 1]
    responses = [rng.integers(3, 21, n).astype(np.int32) for n in lengths]
    return SampledBatch(
        prompt_ids=np.repeat(np.arange(G), K).astype(np.int64), group_ids=np.repeat(np.arange(G), K),
        prompt_tokens=[prompts[i // K] for i in range(G * K)], response_tokens=responses,
        rewards=np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], np.float32),
        logp_behavior=[rng.normal(-3, 0.3, len(r)).astype(np.float32) for r in responses],
        policy_versions=np.zeros(G * K, dtype=np.int64))


def _worker(rank: int, world: int, port: int, path: str) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from hpc_tba.buffer import BufferShard
    from hpc_tba.config import BufferConfig, LearnerConfig
    from hpc_tba.losses import make_config
    from hpc_tba.roles import learner as learner_mod
    from hpc_tba.roles.learner import Learner

    torch.set_num_threads(1)
    gloo_deepspeed(rank, world, port)
    out = {}
    for name, fields in OBJECTIVES.items():
        cfg = LearnerConfig(total_steps=2, prompts_per_step=G, micro_batch_size=2, lr=1e-3, warmup_steps=1,
                            logprob_chunk_tokens=3, grad_clip=CLIP, sync_wire_dtype="fp32",
                            sequence_parallel_size=world)
        learner = Learner(cfg=cfg, loss=make_config(name=name, **fields),
                          shard=BufferShard(BufferConfig(), directory=None), k=K, temperature=0.7,
                          model_path=_model_path(), transport=types.SimpleNamespace(rank=rank),
                          topo=Topology.build(world, world, 0, needs_searchers=False, sp_size=world),
                          sync_group=None, run_dir=os.path.join(os.path.dirname(path), f"{name}{world}_{rank}"))
        seen, step, accumulate = {}, learner.engine.step, learner_mod.microbatch.accumulate

        def capture(*a, seen=seen, step=step, learner=learner, **kw):
            seen["grad"] = torch.cat([safe_get_full_grad(p).flatten() for p in learner.engine.module.parameters()])
            return step(*a, **kw)

        def record(*a, seen=seen, accumulate=accumulate, **kw):
            loss, metrics, logp = accumulate(*a, **kw)
            seen["logp"] = logp.detach().clone()
            return loss, metrics, logp

        learner.engine.step = capture
        learner_mod.microbatch.accumulate = record
        try:
            metrics = learner.train_step(_batch() if learner.sp.is_leader else None)
        finally:
            learner_mod.microbatch.accumulate = accumulate
        params = list(learner.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            weights = torch.cat([p.detach().flatten().clone() for p in params])
        out[name] = {"logp": seen["logp"], "grad": seen["grad"], "weights": weights,
                     "loss": metrics["loss/total"] / world}  # each rank's share: the normaliser is N / L
    if rank == 0:
        torch.save(out, path)  # tensors: a file, not spawn_ranks' return value


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp")
    ports = free_ports(2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the 1-rank reference beside the SP run
        jobs = [pool.submit(spawn_ranks, _worker, world, (world, ports[world - 1], str(tmp / f"sp{world}.pt")),
                            timeout_s=240) for world in (1, 2)]
        for job in jobs:
            job.result()
    return {w: torch.load(tmp / f"sp{w}.pt") for w in (1, 2)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_sp2_equals_one_rank(runs, name):
    one, sp2 = runs[1][name], runs[2][name]
    assert one["grad"].norm() > CLIP, "vacuous: gradient clipping never acts"
    assert (one["logp"] != 0).sum() == sum(len(r) for r in _batch().response_tokens)
    torch.testing.assert_close(sp2["logp"], one["logp"], rtol=1e-5, atol=1e-5)
    assert abs(sp2["loss"] - one["loss"]) <= 1e-5 * max(1.0, abs(one["loss"]))
    scale = float(one["grad"].abs().max())  # TB's gradient reaches ~1e3: 1e-5 of the largest entry
    assert float((sp2["grad"] - one["grad"]).abs().max()) <= 1e-5 * max(1.0, scale)
    torch.testing.assert_close(sp2["weights"], one["weights"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- layout and refusals
def test_layout_follows_the_data_parallel_rank():
    topo = Topology.build(6, 4, 2, sp_size=2)
    assert topo.dp_size == 2 and [topo.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [topo.sp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [topo.shard_of_prompt(p) for p in range(4)] == [0, 2, 0, 2]  # the replicas' leaders
    quotas = [topo.on_policy_quota(j, 3) for j in range(2)]
    assert set().union(*quotas) == {0, 2} and sum(q.get(0, 0) for q in quotas) == 3
    plain = Topology.build(6, 4, 2)
    assert [plain.shard_of_prompt(p) for p in range(4)] == [0, 1, 2, 3]
    with pytest.raises(LayoutError, match="sequence_parallel_size=3 must divide the 4 learner"):
        Topology.build(6, 4, 2, sp_size=3)
    with pytest.raises(LayoutError, match="sequence_parallel_size=4 must divide the 2 slots per node"):
        Topology.build(6, 4, 2, num_nodes=3, slots_per_node=2, sp_size=4)


def test_tensor_parallel_with_sp_is_refused_by_name():
    from hpc_tba.config import LearnerConfig

    with pytest.raises(ValueError, match="tensor_parallel_size=2 with learner.sequence_parallel_size=2.*do not "):
        LearnerConfig(tensor_parallel_size=2, sequence_parallel_size=2)
    with pytest.raises(ValueError, match="sequence_parallel_size and learner.tensor_parallel_size must be >= 1"):
        LearnerConfig(sequence_parallel_size=0)


def test_sp_refuses_heads_it_cannot_split_and_masked_attention():
    from hpc_tba.roles import parallel

    sp = parallel.SequenceParallel(size=2, rank=0, group=None, leader=0)

    def model(heads, kv, impl):
        return types.SimpleNamespace(config=types.SimpleNamespace(
            num_attention_heads=heads, num_key_value_heads=kv, _attn_implementation=impl))

    with pytest.raises(ValueError, match="sequence_parallel_size=2 must divide the model's 3 attention heads"):
        parallel.enable(model(3, 3, "sdpa"), sp)
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads and 1 key/value"):
        parallel.enable(model(4, 1, "sdpa"), sp)
    with pytest.raises(ValueError, match="needs sdpa or flash attention.*'eager'"):
        parallel.enable(model(2, 2, "eager"), sp)


def test_local_windows_cover_the_padded_sequence():
    from hpc_tba.roles import parallel

    ids = torch.arange(10).reshape(2, 5)
    parts = [parallel.SequenceParallel(3, r, None, 0).local_inputs(ids) for r in range(3)]
    assert [(a, b) for _, a, b in parts] == [(0, 2), (2, 4), (4, 6)]
    torch.testing.assert_close(torch.cat([p["input_ids"] for p, _, _ in parts], 1)[:, :5], ids)
    assert parts[2][0]["position_ids"].tolist() == [[4, 5], [4, 5]]


# ---------------------------------------------------------------- planner
def test_planner_splits_activations_and_names_the_next_lever():
    from hpc_tba.assembly.compose import compose
    from hpc_tba.planner import PlanOptions, make_plan

    fast = PlanOptions(deepspeed=False)
    long = ["+experiment=tba_70b", "searcher.max_new_tokens=32256", "searcher.max_model_len=32768",
            "learner.micro_batch_size=1"]
    one = make_plan(compose(long), fast)
    assert not one.fits and "learner.micro_batch_size" not in one.problems[0]  # it is already 1
    assert "set learner.sequence_parallel_size=2" in one.problems[0], one.problems
    two = make_plan(compose([*long, "learner.sequence_parallel_size=2"]), fast)
    assert two.fits, two.problems
    assert two.micro_batch_tokens == 16384 and two.terms["activations"] == pytest.approx(one.terms["activations"] / 2)
    preset = make_plan(compose(["+experiment=tba_70b_long"]), fast)
    assert preset.fits, preset.problems
    assert compose(["+experiment=tba_70b_long"]).searcher.max_new_tokens >= 32768


# ---------------------------------------------------------------- end to end
@pytest.mark.long
def test_train_with_sp2_syncs_exactly(tmp_path):
    """`hpc-tba train cluster.num_learners=2 learner.sequence_parallel_size=2 learner.sync_check=true`:
    the weights the searchers receive (gathered ZeRO-3 shards) give the learner's log-probs."""
    import json
    import subprocess

    from conftest import HPC_TBA

    run_dir = tmp_path / "run"
    cmd = [HPC_TBA, "train", "cluster.num_learners=2", "learner.sequence_parallel_size=2",
           "learner.sync_check=true", "learner.total_steps=4", "learner.sync_every=2", "learner.eval_every=0",
           "cluster.num_searchers=1", f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    gaps = summary["sync_logprob_gap"]["2"]
    assert sorted(int(v) for v in gaps) == [2, 4] and max(gaps.values()) < 1e-4, gaps
    assert (run_dir / "final_model" / "config.json").is_file()
