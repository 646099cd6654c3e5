"""Issue 16 defects that CPU can show: metric reduction with a fixed key set (NaN for missing
values, on 2 gloo ranks), LOCAL_RANK among the GPUs a rank sees, the rendezvous host, NCCL group
timeouts, DeepSpeed memory options, chunked log-probs equal to full-logit ones."""
from __future__ import annotations

import datetime
import glob
import math
import os
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import gloo_group, spawn_ranks

from hpc_tba.comm import groups
from hpc_tba.comm.groups import free_ports
from hpc_tba.config.topology import Topology


# ---------------------------------------------------------------- reduce_metrics on 2 ranks
def _metrics_main(rank: int, port: int) -> dict:
    from hpc_tba.comm.metrics import reduce_metrics

    with gloo_group(rank, 2, port):
        # rank 0 got no fresh samples this step: its incoming reward is NaN, not absent
        m = {"reward/incoming_mean": math.nan if rank == 0 else 0.75, "loss/total": 1.0 + rank,
             "sync/gap": math.nan, "x": 2.0 * rank}
        out = {"mean": reduce_metrics(m, sum_prefix=("loss/",)), "max": reduce_metrics(m, op="max"),
               "min": reduce_metrics(m, op="min")}
        try:
            reduce_metrics({"only_on_rank": 1.0} if rank else {"other": 1.0})
            out["mismatch"] = "no error"
        except RuntimeError as e:
            out["mismatch"] = str(e)
    return out


def test_reduce_metrics_nan_aware_fixed_keys_two_ranks():
    out = spawn_ranks(_metrics_main, 2, (PORT,), timeout_s=150)[0]
    assert out["mean"] == {"reward/incoming_mean": 0.75, "loss/total": 3.0, "x": 1.0}  # sync/gap: NaN everywhere
    assert out["max"]["x"] == 2.0 and out["min"]["x"] == 0.0 and out["min"]["reward/incoming_mean"] == 0.75
    assert "different metric keys" in out["mismatch"]


PORT = free_ports(1)[0]


# ---------------------------------------------------------------- LOCAL_RANK, host, timeouts
def _topo():  # 2 learner nodes of 4 GPUs, one searcher node
    return Topology.build(12, 8, 4, num_nodes=3, slots_per_node=4)


def test_local_rank_is_the_index_among_visible_gpus():
    topo, rdv = _topo(), {"host": "10.0.0.1", "learner_port": 1}
    assert groups.learner_env(topo, 5, rdv, {"CUDA_VISIBLE_DEVICES": "1"})["LOCAL_RANK"] == "0"  # pinned
    assert groups.learner_env(topo, 5, rdv, {})["LOCAL_RANK"] == "1"  # node-local, unpinned
    assert groups.learner_env(topo, 5, rdv, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})["LOCAL_RANK"] == "1"
    env = groups.learner_env(topo, 5, rdv, {"CUDA_VISIBLE_DEVICES": "1"})
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8"
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        groups.local_device_index(topo, 5, {"CUDA_VISIBLE_DEVICES": "2,3"})
    # on CPU (gloo, no GPU) a stray CUDA_VISIBLE_DEVICES is not consulted
    assert groups.local_device_index(topo, 5, {"CUDA_VISIBLE_DEVICES": "2,3"}, gpus=False) == 1


def test_rendezvous_host(monkeypatch):
    table = {"gpu001": "10.1.0.1", "vm": "127.0.1.1"}

    def resolve(name):
        if name not in table:
            raise OSError(name)
        return table[name]

    monkeypatch.setattr(groups.socket, "gethostbyname", resolve)
    monkeypatch.setattr(groups.socket, "gethostname", lambda: "vm")
    two = ["gpu001", "gpu002"]
    assert groups.rendezvous_host(two, {"SLURM_JOB_NODELIST": "gpu[001-002]"}) == "10.1.0.1"
    assert groups.rendezvous_host(two, {"HPC_TBA_MASTER_ADDR": "10.9.9.9"}) == "10.9.9.9"
    assert groups.rendezvous_host(["vm", "vm"], {}) == "127.0.1.1"  # one machine: loopback is fine
    assert groups.rendezvous_host(["vm"], {"SLURM_JOB_NODELIST": "n[0-2]"}) == "127.0.0.1"  # virtual nodes
    with pytest.raises(RuntimeError, match="loopback.*HPC_TBA_MASTER_ADDR"):
        groups.rendezvous_host(["vm", "other"], {})
    with pytest.raises(RuntimeError, match="does not resolve"):
        groups.rendezvous_host(two, {"SLURM_JOB_NODELIST": "node[7-8]"})


def test_every_nccl_group_gets_the_gloo_timeout(monkeypatch):
    """setup_groups on a learner that is also the sync root, NCCL faked: both groups 1,800 s."""
    import deepspeed

    from hpc_tba.comm.weight_sync import group as sync_group

    seen = {}

    class NcclOptions:
        _timeout = datetime.timedelta(minutes=10)

    class FakeNCCL:
        Options = NcclOptions

        def __init__(self, store, rank, size, opts=None):
            seen["sync_timeout"] = None if opts is None else opts._timeout

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **kw: object())
    monkeypatch.setattr(sync_group, "_STORES", {})
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("device", i))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.update(init=kw))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("HPC_TBA_MASTER_ADDR", "10.0.0.1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    transport = types.SimpleNamespace(rank=0, allgather_json=lambda x: [x, "b"], bcast_json=lambda obj: obj)
    topo = Topology.build(2, 1, 1)
    groups.setup_groups(transport, topo, backend="nccl")
    assert seen["init"]["timeout"] == datetime.timedelta(seconds=1800)
    assert seen["sync_timeout"] == datetime.timedelta(seconds=1800)
    assert seen["device"] == 0 and os.environ["LOCAL_RANK"] == "0"


# ---------------------------------------------------------------- DeepSpeed options
def test_memory_options_reach_the_deepspeed_config():
    from hpc_tba.config import LearnerConfig
    from hpc_tba.roles.learner import deepspeed_config

    ds = deepspeed_config(LearnerConfig(offload_optimizer=True, offload_params=True), micro_batch=4, train=True)
    z = ds["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 1
    plain = deepspeed_config(LearnerConfig(), micro_batch=4, train=False)["zero_optimization"]
    assert "offload_optimizer" not in plain and "offload_param" not in plain


@pytest.mark.parametrize("option, stage", [("offload_params", 2), ("offload_params", 0), ("offload_optimizer", 0)])
def test_memory_option_deepspeed_would_ignore_is_refused(option, stage):
    """An offload the ZeRO stage cannot apply is an error naming both fields, not a silent no-op."""
    from hpc_tba.config import LearnerConfig
    from hpc_tba.roles.learner import deepspeed_config

    with pytest.raises(ValueError, match=f"learner.{option} needs learner.zero_stage.*got {stage}"):
        deepspeed_config(LearnerConfig(zero_stage=stage, **{option: True}), micro_batch=4, train=True)


# ---------------------------------------------------------------- chunked log-probs
def _old_logprobs(model, batch, temperature):  # the full-logits implementation it replaces
    from hpc_tba.losses import token_logprobs

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    idx = batch.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    return token_logprobs(logits.gather(1, idx), batch.response_ids, temperature=temperature).masked_fill(
        ~batch.response_mask, 0.0)


@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_chunked_logprobs_equal_full_logits(chunk):
    from transformers import AutoModelForCausalLM

    from hpc_tba.roles.policy import pack, response_logprobs

    path = sorted(p for p in glob.glob(os.path.expanduser("~/.cache/hpc_tba/models/tiny-llama-*"))
                  if not p.endswith(".lock"))[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = np.random.default_rng(0)
    batch = pack([rng.integers(3, 21, rng.integers(2, 9)) for _ in range(6)],
                 [rng.integers(3, 21, rng.integers(1, 12)) for _ in range(6)], pad_id=0)
    ref = _old_logprobs(model, batch, 0.7)
    ref.sum().backward()
    g_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = response_logprobs(model, batch, temperature=0.7, chunk_tokens=chunk)
    got.sum().backward()
    assert type(model.lm_head).forward is not None and "forward" not in vars(model.lm_head)  # restored
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)  # |logp| up to ~30: 1-2 fp32 ulps
    for a, b in zip(model.parameters(), g_ref):
        torch.testing.assert_close(a.grad, b, rtol=1e-4, atol=1e-4)
    m64 = model.double()  # in float64 the two are the same computation: equal to rounding
    with torch.no_grad():
        logits = m64(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits / 0.7
        picked = torch.log_softmax(logits, -1).gather(1, batch.logit_index.unsqueeze(-1).expand(
            -1, -1, logits.shape[-1])).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(response_logprobs(m64, batch, temperature=0.7, chunk_tokens=chunk),
                                   picked.masked_fill(~batch.response_mask, 0.0), rtol=1e-12, atol=1e-12)
