"""Every setting is the one the run uses (issue 23): the DeepSpeed options the learner writes,
read back from real engines (one gloo rank, DeepSpeed's CPU accelerator).

`learner.grad_clip=0` means no clipping: DeepSpeed 0.19.8 clips at 1.0 when the config leaves
`gradient_clipping` out, so the learner always writes it. The numeric check uses SGD, whose step
is proportional to the gradient (Adam's first step hardly depends on the gradient's scale), on a
gradient of norm ~1,000.
"""
from __future__ import annotations

import pytest
import torch
from conftest import gloo_deepspeed, spawn_ranks

from hpc_tba.comm.groups import free_ports

LR = 0.1


def _sgd_step(cfg) -> dict:
    """One SGD step through the DeepSpeed engine built from the learner's config for `cfg`, on a
    fixed gradient G (loss = sum(W * G)); returns the step taken, G and what the engine reports."""
    import deepspeed

    from hpc_tba.roles.learner import deepspeed_config

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, bias=False)
    grad = torch.arange(64, dtype=torch.float32).reshape(8, 8) * 10.0  # norm ~2,900
    ds = deepspeed_config(cfg, micro_batch=1, train=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=ds)
    w = engine.module.weight
    with deepspeed.zero.GatheredParameters([w]):
        before = w.detach().clone().float()
    out = engine(torch.eye(8, dtype=w.dtype))  # = W^T (ZeRO-3 gathers W inside the forward)
    loss = (out * grad.t().to(out.dtype)).sum()  # = sum(W * G): dloss/dW = G
    engine.backward(loss)
    engine.step()
    with deepspeed.zero.GatheredParameters([w]):
        after = w.detach().clone().float()
    return {"step": (after - before).numpy(), "grad": grad.numpy(), "clip": engine.gradient_clipping()}


def _worker(rank: int, port: int) -> dict:
    from hpc_tba.config import LearnerConfig

    gloo_deepspeed(rank, 1, port)
    return {"clip0": _sgd_step(LearnerConfig(grad_clip=0.0)),
            "clip05": _sgd_step(LearnerConfig(grad_clip=0.5))}


@pytest.fixture(scope="module")
def engines() -> dict:
    return spawn_ranks(_worker, 1, (free_ports(1)[0],), timeout_s=300)[0]


def test_grad_clip_zero_means_no_clipping(engines):
    import numpy as np

    off, on = engines["clip0"], engines["clip05"]
    # unclipped: the SGD step is exactly -lr * G (DeepSpeed's default would scale it by 1/||G||)
    np.testing.assert_allclose(off["step"], -LR * off["grad"], rtol=1e-5, atol=1e-6)
    assert off["clip"] == 0.0 and on["clip"] == 0.5  # what the engine uses, read back
    g = on["grad"]
    np.testing.assert_allclose(on["step"], -LR * g * 0.5 / np.linalg.norm(g), rtol=1e-4, atol=1e-7)
