"""The learner's parameters have exactly the dtype the config names, on every accelerator.

DeepSpeed 0.19's zero.Init turned an explicit fp32 into bf16 on accelerators that report no fp16
support (the CPU accelerator on CPUs without mkldnn fp16, e.g. AMD EPYC with avx512_bf16), so a
suite green on one CPU trained in bf16 on another. The workers here make the accelerator report
no fp16 support, so the check does not depend on the CPU it runs on (2 gloo ranks).
"""

import pytest
import torch
import torch.multiprocessing as mp
from conftest import gloo_deepspeed

from hpc_tba.comm.groups import free_ports


def _worker(rank, world, port, path, fp16_supported, out):
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from hpc_tba.config import LearnerConfig
    from hpc_tba.models.loading import load_causal_lm
    from hpc_tba.roles.learner import deepspeed_config

    acc = get_accelerator()
    acc.is_fp16_supported = lambda: fp16_supported
    gloo_deepspeed(rank, world, port)
    seen = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        cfg = deepspeed_config(LearnerConfig(dtype=name), micro_batch=1, train=True)
        model = load_causal_lm(path, dtype=dtype, zero3_config=cfg, rank=rank)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                          config=cfg)
        seen[name] = sorted({str(t.dtype) for p in engine.module.parameters() for t in (p, p.ds_tensor)})
    out[rank] = seen


@pytest.mark.parametrize("fp16_supported", [False, True], ids=["no-fp16-accelerator", "fp16-accelerator"])
def test_every_parameter_has_the_configured_dtype_on_every_rank(fp16_supported):
    from hpc_tba.config import ModelConfig, TaskConfig
    from hpc_tba.tasks.embedded import resolve_model_path

    path = resolve_model_path(ModelConfig(), TaskConfig())
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(2, free_ports(1)[0], path, fp16_supported, out), nprocs=2, join=True)
    want = {"fp32": ["torch.float32"], "bf16": ["torch.bfloat16"]}
    assert dict(out) == {0: want, 1: want}


def test_a_parameter_of_another_dtype_is_named():
    from hpc_tba.models.loading import check_dtype

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].bias.data = model[1].bias.data.to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"1\.bias is torch\.bfloat16, the config asked for torch\.float32"):
        check_dtype(model, torch.float32, where="m")
