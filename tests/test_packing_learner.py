"""The real Learner on 2 ZeRO-3 gloo ranks: a step with `learner.micro_batch_tokens` (packed bins)
equals the same step in padded micro-batches of 2 sequences: log-probs, loss, the whole gradient
and the weights after the update (tests/parallel_harness.py's equality, fp32), for TB and for
GRPO with a KL term (a reference model's log-probs through the packed rows too)."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import gloo_deepspeed, spawn_ranks
from parallel_harness import assert_equals_one_rank, build_learner, captured_step
from parallel_harness import batch as _batch

from hpc_tba.comm.groups import free_ports

NAMES = ("tb", "grpo")
BUDGET = 24  # the batch's longest sequence is 18 tokens: bins of 1-3 sequences, groups split


def _worker(rank: int, world: int, port: int, path: str) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    torch.set_num_threads(1)
    gloo_deepspeed(rank, world, port)
    out, tmp = {}, os.path.dirname(path)
    for name in NAMES:
        for tokens in (0, BUDGET):
            learner = build_learner(rank, world, name, os.path.join(tmp, f"{name}{tokens}_{rank}"),
                                    micro_batch_tokens=tokens)
            data = _batch() if rank == 0 else _batch(seed=12)  # each rank its own shard's batch
            res = captured_step(learner, data, full_grad=safe_get_full_grad,
                                gathered=lambda ps: deepspeed.zero.GatheredParameters(ps))
            out[(name, tokens)] = res
    if rank == 0:
        torch.save(out, path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("packing") / "out.pt"
    spawn_ranks(_worker, 2, (2, free_ports(1)[0], str(path)), timeout_s=600)
    return torch.load(path)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", NAMES)
def test_a_packed_step_equals_the_padded_step_on_two_ranks(runs, name):
    assert_equals_one_rank(runs[(name, 0)], runs[(name, BUDGET)])
