"""Learner tensor parallelism (DeepSpeed AutoTP) is exact (issue 25): the real Learner (ZeRO-3,
CPU, fp32, gradient clipping on) with learner.tensor_parallel_size=2 on 2 gloo ranks gives, for
TB, TOPR, GRPO and A-LoL, the same log-probs, loss, gradients (TP slices gathered) and post-step
weights as one rank (1e-5), on a batch whose responses do not divide evenly and whose groups
differ in length; the weights the sender packs for the searchers, the exported safetensors and a
checkpoint round trip are whole and equal TP=1's. One spawn of each world size for the file.
Plus the DeepSpeed config read back from the engine, the layout and the refusals by name, and the
planner's TP rows.
"""
from __future__ import annotations

import concurrent.futures
import os

import numpy as np
import pytest
import torch
from conftest import gloo_deepspeed, spawn_ranks
from parallel_harness import (
    CLIP,
    OBJECTIVES,
    G,
    assert_equals_one_rank,
    build_learner,
    captured_step,
    one_and_two_ranks,
)
from parallel_harness import batch as _batch

from hpc_tba.comm.groups import free_ports
from hpc_tba.config.topology import LayoutError, Topology


def _full_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """The whole gradient of `p`: ZeRO-3's gather of this rank's slice, then the TP slices."""
    import torch.distributed as dist
    from deepspeed.module_inject.layers import LinearAllreduce
    from deepspeed.utils import groups, safe_get_full_grad

    from hpc_tba.roles import tensor_parallel

    g = safe_get_full_grad(p)
    layer = tensor_parallel.split_layer(p)
    if layer is None:
        return g
    dim = 1 if isinstance(layer, LinearAllreduce) and p is layer.weight else 0
    assert len(set(layer._partition_sizes)) == 1, "the tiny model splits evenly"
    group = groups.get_tensor_model_parallel_group()
    parts = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, g.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _sync_weights(learner) -> list[torch.Tensor]:
    """What the sender packs into its buckets (every rank gathers; rank 0 broadcasts these)."""
    sender, m = learner.sender, learner.manifest
    out = []
    for b, idx in enumerate(m.buckets):
        flat = sender._free_slot(b % 2, m.bucket_numel(b))
        sender._gather([sender.params[i] for i in idx], b % 2, flat, pack=True)
        out.append(flat.clone())
    return out


def _read_back(engine) -> dict:
    tp = engine._config.tensor_parallel_config
    part = tp.partition_config or {}
    return {"autotp_size": engine.autotp_size(), "tp_size": tp.tensor_parallel.tp_size,
            "tp_grain_size": tp.tensor_parallel.tp_grain_size,
            "vocab_parallel_lm_head": tp.vocab_parallel_lm_head, "tp_overlap_comm": tp.tp_overlap_comm,
            "use_default_specs": part.get("use_default_specs"), "strict_mode": part.get("strict_mode"),
            "preset_model": tp.preset_model, "clip": engine.gradient_clipping()}


def _learner(rank: int, world: int, tp: int, name: str, run_dir: str):
    learner = build_learner(rank, world, name, run_dir, tp=tp, param_persistence_threshold=0)
    for p in learner.engine.module.parameters():
        assert p.ds_tensor.dtype == torch.float32, "fp32 asked, fp32 built"
    return learner


def _step(learner, batch) -> dict:
    from hpc_tba.roles import tensor_parallel

    return captured_step(learner, batch, full_grad=_full_grad, gathered=tensor_parallel.gathered)


def _worker(rank: int, world: int, port: int, path: str) -> None:
    import deepspeed  # noqa: F401 - DeepSpeed's accelerator before torch.distributed
    from safetensors.torch import load_file

    from hpc_tba.checkpoint import store as checkpoint
    from hpc_tba.roles import tensor_parallel

    torch.set_num_threads(1)
    gloo_deepspeed(rank, world, port)
    out, tmp = {}, os.path.dirname(path)
    for name in OBJECTIVES:
        learner = _learner(rank, world, world, name, os.path.join(tmp, f"{name}{world}_{rank}"))
        res = _step(learner, _batch())  # rank 0 leads the one replica: normaliser N / D, D = 1
        if name == "tb":  # the gathers for sync, export and a checkpoint round trip, once
            res["sync"] = _sync_weights(learner)
            res["manifest"] = learner.manifest.to_json()
            export = os.path.join(tmp, f"export{world}")
            checkpoint.export_hf(learner.engine, export, tokenizer_src=None, learner_rank=rank)
            if rank == 0:
                res["export"] = {}
                for f in sorted(os.listdir(export)):
                    if f.endswith(".safetensors"):
                        res["export"].update(load_file(os.path.join(export, f)))
            saved = checkpoint.save(learner.engine, run_dir=os.path.join(tmp, f"ckpt{world}"), step=1,
                                    learner_rank=rank, shard_state={}, learner_state={"step": 1}, keep_last=1)
            learner.train_step(_batch() if learner.peers.is_leader else None)  # move the weights on
            checkpoint.load(learner.engine, saved, learner_rank=rank)
            params = list(learner.engine.module.parameters())
            with tensor_parallel.gathered(params):
                res["reloaded"] = torch.cat([p.detach().flatten().clone() for p in params])
            if world > 1:
                res["ds"] = _read_back(learner.engine)
        out[name] = res
    if rank == 0:
        torch.save(out, path)  # tensors: a file, not spawn_ranks' return value


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return one_and_two_ranks(tmp_path_factory.mktemp("tp"), _worker, timeout_s=300)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_tp2_equals_one_rank(runs, name):
    assert_equals_one_rank(runs[1][name], runs[2][name])


@pytest.mark.timeout(360)
def test_searchers_export_and_checkpoint_get_whole_weights(runs):
    one, tp2 = runs[1]["tb"], runs[2]["tb"]
    assert tp2["manifest"] == one["manifest"]  # names, whole shapes, buckets: what searchers map
    assert len(tp2["sync"]) == len(one["sync"])
    for a, b in zip(tp2["sync"], one["sync"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(tp2["sync"]), tp2["weights"], rtol=0, atol=0)  # fp32 wire
    assert tp2["export"].keys() == one["export"].keys()
    for k, t in one["export"].items():
        torch.testing.assert_close(tp2["export"][k], t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tp2["reloaded"], tp2["weights"], rtol=0, atol=0)  # the checkpoint's step
    assert tp2["ds"] == {"autotp_size": 2, "tp_size": 2, "tp_grain_size": 1, "vocab_parallel_lm_head": False,
                         "tp_overlap_comm": False,
                         "use_default_specs": False, "strict_mode": True, "preset_model": None, "clip": CLIP}


# ---------------------------------------------------------------- layout and refusals
def test_layout_follows_the_data_parallel_rank():
    topo = Topology.build(6, 4, 2, learner_tp_size=2)
    assert topo.dp_size == 2 and topo.replica_size == 2 and [topo.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [topo.tp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [topo.shard_of_prompt(p) for p in range(4)] == [0, 2, 0, 2]  # the replicas' leaders
    with pytest.raises(LayoutError, match="tensor_parallel_size=3 must divide the 4 learner"):
        Topology.build(6, 4, 2, learner_tp_size=3)
    with pytest.raises(LayoutError, match="tensor_parallel_size=4 must divide the 2 slots per node"):
        Topology.build(6, 4, 2, num_nodes=3, slots_per_node=2, learner_tp_size=4)
    with pytest.raises(LayoutError, match="tensor_parallel_size=2 with learner.sequence_parallel_size=2"):
        Topology.build(6, 4, 2, sp_size=2, learner_tp_size=2)


def test_refusals_by_name():
    from hpc_tba.config import LearnerConfig
    from hpc_tba.roles import tensor_parallel
    from hpc_tba.roles.ds_config import deepspeed_config

    with pytest.raises(ValueError, match="tensor_parallel_size=2 with learner.sequence_parallel_size=2.*do not "):
        LearnerConfig(tensor_parallel_size=2, sequence_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs learner.zero_stage=3"):
        LearnerConfig(tensor_parallel_size=2, zero_stage=2)
    assert "tensor_parallel" not in deepspeed_config(LearnerConfig(), micro_batch=1, train=True)
    assert deepspeed_config(LearnerConfig(tensor_parallel_size=2), micro_batch=1, train=True)[
        "tensor_parallel"]["autotp_size"] == 2

    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 32,
             "head_dim": 16}
    with torch.device("meta"):
        llama = LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **small))
        qwen3 = Qwen3ForCausalLM(Qwen3Config(num_attention_heads=4, num_key_value_heads=4, **small))
    tensor_parallel.check_model(llama, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide the model's 4 attention heads and 2"):
        tensor_parallel.check_model(llama, 4)
    with pytest.raises(ValueError, match=r"has model.layers.0.self_attn.q_norm.weight.*not supported"):
        tensor_parallel.check_model(qwen3, 2)
    llama.model.layers[0].mlp.router = torch.nn.Linear(64, 4, device="meta")  # a Linear no spec names
    with pytest.raises(ValueError, match=r"has model.layers.0.mlp.router.weight"):
        tensor_parallel.check_model(llama, 2)


# ---------------------------------------------------------------- planner
def test_planner_splits_layers_and_activations():
    from hpc_tba.assembly.compose import compose
    from hpc_tba.plan.planner import PlanOptions, format_plan, make_plan

    fast = PlanOptions(deepspeed=False)
    for ckpt in ("false", "true"):
        base = ["+experiment=tba_70b", "searcher.max_new_tokens=7680", "searcher.max_model_len=8192",
                "learner.micro_batch_size=1", f"learner.gradient_checkpointing={ckpt}"]
        one, two = (make_plan(compose([*base, f"learner.tensor_parallel_size={tp}"]), fast) for tp in (1, 2))
        assert "tensor parallel 2" in format_plan(two) and "tensor parallel" not in format_plan(one)
        # heads and MLP halve, the norms' full-width tensors (and checkpointed layer inputs) do not
        assert one.terms["activations"] / 2 < two.terms["activations"] < one.terms["activations"]
        assert two.terms["logits"] == one.terms["logits"]  # the head is replicated
        # model states stay P / N: each TP slice is partitioned over the N / TP data-parallel ranks
        assert all(two.terms[k] == one.terms[k] for k in ("params", "grads", "optimizer", "reference"))
        # the 70B's largest gathered layer is its (replicated) embedding: the split leaves it whole
        assert two.terms["gathered"] == one.terms["gathered"]
    heads = make_plan(compose([*base, "learner.tensor_parallel_size=16", "cluster.gpus_per_node=16", "cluster.nodes=8",
                               "searcher.tensor_parallel_size=4"]), fast)
    assert any("tensor_parallel_size=16 must divide the model's 64 attention heads and 8" in p
               for p in heads.problems), heads.problems
    dry = make_plan(compose(["cluster.num_learners=2", "learner.tensor_parallel_size=2"]),
                    PlanOptions(deepspeed=False, dry_run=True))
    assert dry.fits, dry.problems
    row = next(ln for ln in dry.lines if "decoder layer on one TP rank (TP 2)" in ln)
    assert row.endswith("ok"), row


def test_planner_names_tensor_parallelism_when_it_fits():
    from hpc_tba.assembly.compose import compose
    from hpc_tba.plan.planner import PlanOptions, make_plan

    fast = PlanOptions(deepspeed=False)
    for tokens in range(8192, 65537, 2048):  # the first length the 70B layout refuses
        plan = make_plan(compose(["+experiment=tba_70b", f"searcher.max_new_tokens={tokens - 512}",
                                  f"searcher.max_model_len={tokens}", "learner.micro_batch_size=1"]), fast)
        if not plan.fits:
            break
    text = plan.problems[0]
    assert "learner.micro_batch_size" not in text and "set learner.sequence_parallel_size=2" in text, text
    assert "or set learner.tensor_parallel_size=" in text, text
    tp = int(text.split("learner.tensor_parallel_size=")[1].split()[0])
    fixed = make_plan(compose(["+experiment=tba_70b", f"searcher.max_new_tokens={tokens - 512}",
                               f"searcher.max_model_len={tokens}", "learner.micro_batch_size=1",
                               f"learner.tensor_parallel_size={tp}"]), fast)
    assert fixed.fits, fixed.problems


# ---------------------------------------------------------------- data x tensor parallel
def _dp_tp_worker(rank: int, world: int, port: int, path: str) -> None:
    """world 4: two replicas of TP 2, each its own batch; world 1: both batches at once."""
    from hpc_tba.comm.messages import SampledBatch

    torch.set_num_threads(1)
    gloo_deepspeed(rank, world, port)
    a, b = _batch(11), _batch(12)
    both = SampledBatch(**{f: (np.concatenate([getattr(a, f), getattr(b, f) + (G if f == "group_ids" else 0)])
                               if isinstance(getattr(a, f), np.ndarray) else getattr(a, f) + getattr(b, f))
                           for f in ("prompt_ids", "group_ids", "prompt_tokens", "response_tokens", "rewards",
                                     "logp_behavior", "policy_versions")})
    out = {}
    for name in ("tb", "grpo"):
        run_dir = os.path.join(os.path.dirname(path), f"{name}{world}_{rank}")
        learner = _learner(rank, world, 2 if world > 1 else 1, name, run_dir)
        out[name] = _step(learner, both if world == 1 else (a, b)[rank // 2])
    torch.save(out, f"{path}.{rank}")


@pytest.mark.long
@pytest.mark.timeout(900)
def test_two_replicas_of_tp2_equal_one_rank(tmp_path):
    """D = 2 replicas of TP 2 (4 ranks): the normaliser's D = L / TP, the TP slices averaged over
    the data-parallel group, the replicated parameters over all four ranks."""
    ports = free_ports(2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(spawn_ranks, _dp_tp_worker, world, (world, ports[world // 4], str(tmp_path / f"w{world}")),
                            timeout_s=800) for world in (1, 4)]
        for job in jobs:
            job.result()
    one = torch.load(tmp_path / "w1.0")
    ranks = [torch.load(tmp_path / f"w4.{r}") for r in range(4)]
    rows = len(_batch().response_tokens)
    for name in ("tb", "grpo"):
        ref = one[name]
        for r, res in enumerate(ranks):
            mine = res[name]
            part = ref["logp"][(r // 2) * rows: (r // 2 + 1) * rows]
            t = mine["logp"].shape[1]
            torch.testing.assert_close(mine["logp"], part[:, :t], rtol=1e-5, atol=1e-5)
            assert not part[:, t:].any()
            scale = float(ref["grad"].abs().max())
            assert float((mine["grad"] - ref["grad"]).abs().max()) <= 1e-5 * max(1.0, scale), (name, r)
            torch.testing.assert_close(mine["weights"], ref["weights"], rtol=1e-5, atol=1e-5)
        loss = (ranks[0][name]["loss"] + ranks[2][name]["loss"]) / 2  # each leader: its rows / (N / D)
        assert abs(loss - ref["loss"]) <= 1e-5 * max(1.0, abs(ref["loss"]))


# ---------------------------------------------------------------- end to end
@pytest.mark.long
def test_train_with_tp2_syncs_exactly(tmp_path):
    """`hpc-tba train cluster.num_learners=2 learner.tensor_parallel_size=2 learner.sync_check=true`:
    the weights the searcher receives (ZeRO-3 partitions and TP slices gathered) give the
    learner's log-probs."""
    import json
    import subprocess

    from conftest import HPC_TBA

    run_dir = tmp_path / "run"
    cmd = [HPC_TBA, "train", "cluster.num_learners=2", "learner.tensor_parallel_size=2",
           "learner.sync_check=true", "learner.total_steps=4", "learner.sync_every=2", "learner.eval_every=0",
           "cluster.num_searchers=1", f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    gaps = summary["sync_logprob_gap"]["2"]
    print(f"TP=2 sync probe gap: {gaps}")
    assert sorted(int(v) for v in gaps) == [2, 4] and max(gaps.values()) < 1e-4, gaps
    assert (run_dir / "final_model" / "config.json").is_file()
