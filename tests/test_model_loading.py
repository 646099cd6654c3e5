"""Under ZeRO-3 the learner builds the model partitioned and streams the safetensors in: the
gathered result must equal transformers' own from_pretrained, on every rank (2 gloo ranks)."""
import socket

import torch
import torch.multiprocessing as mp
from conftest import gloo_deepspeed


def _worker(rank, world, port, path, out):
    import deepspeed
    from transformers import AutoModelForCausalLM

    from hpc_tba.config import LearnerConfig
    from hpc_tba.models.loading import load_causal_lm
    from hpc_tba.roles.learner import deepspeed_config

    gloo_deepspeed(rank, world, port)
    cfg = deepspeed_config(LearnerConfig(), micro_batch=1, train=True)
    model = load_causal_lm(path, dtype=torch.float32, zero3_config=cfg, rank=rank)
    params = dict(model.named_parameters())
    assert all(hasattr(p, "ds_id") for p in params.values())  # partitioned, not whole
    assert all(p.ds_tensor.numel() < p.ds_numel for p in params.values() if p.ds_numel > 1)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    with deepspeed.zero.GatheredParameters(list(params.values())):
        bad = [n for n, p in params.items() if not torch.equal(p.data, ref[n])]
    out[rank] = bad


def test_zero3_load_equals_from_pretrained():
    from hpc_tba.config import ModelConfig, TaskConfig
    from hpc_tba.tasks.embedded import resolve_model_path

    path = resolve_model_path(ModelConfig(), TaskConfig())
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(2, port, path, out), nprocs=2, join=True)
    assert dict(out) == {0: [], 1: []}
