"""Sharding invariance: a batch split over 2 gloo ranks, gradients all-reduced (SUM), equals one process.

The batch is split by prompt group (every sample of a prompt on one rank, as the buffer routes
them) into uneven shards, one with a fully masked padding row. Each rank passes the global number
of loss units (`loss_units` all-reduced) as `normalizer`. A control case shows that averaging
per-rank means instead gives a different gradient, so the comparison can fail.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from conftest import gloo_group, spawn_ranks

from hpc_tba.comm.groups import free_ports
from hpc_tba.losses import (
    LossInputs,
    compute_loss,
    loss_units,
    make_config,
    token_logprobs,
)

CASES = {
    "tb": {"name": "tb", "beta0": 0.004, "beta_final": 0.004},
    "tb_learned": {"name": "tb", "tb_logz": "learned", "beta0": 0.05, "beta_final": 0.05},
    "topr": {"name": "topr"},
    "topr_tis": {"name": "topr", "topr_pos_min": 0.0, "topr_positive_threshold": 0.5, "topr_baseline": 0.5},
    "alol": {"name": "alol"},
    "alol_ref_free": {"name": "alol", "alol_variant": "ref_free"},
    "alol_seq": {"name": "alol", "alol_variant": "seq"},
    "alol_kl": {"name": "alol", "alol_variant": "kl", "alol_kl_beta": 0.1},
    "r_lol": {"name": "alol", "alol_variant": "r_lol"},
    "grpo": {"name": "grpo", "kl_coef": 0.04},
    "rloo": {"name": "rloo", "kl_coef": 0.1},
    "dpo": {"name": "dpo"},
    "dpo_all": {"name": "dpo", "dpo_pairing": "all"},
    "sft": {"name": "sft"},
}
GROUP_SIZES = (3, 4, 2, 1, 4)      # prompt groups; the size-1 group exercises groups of one
SHARDS = ((0, 3), (1, 2, 4))       # groups per rank: uneven in samples and in DPO pairs
T, V, H = 6, 7, 5


def _batch():
    """The full batch (deterministic): features, tokens, mask, rewards, group ids, advantages."""
    g = torch.Generator().manual_seed(1234)
    gid = torch.cat([torch.full((n,), k) for k, n in enumerate(GROUP_SIZES)])
    B = gid.numel()
    feats = torch.randn(B, T, H, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask[5] = False                                         # a padding row in group 1
    rewards = (torch.rand(B, generator=g) > 0.5).float()
    adv = torch.randn(B, generator=g)
    w_ref, w_beh = torch.randn(H, V, generator=g), torch.randn(H, V, generator=g)
    return {"feats": feats, "tokens": tokens, "mask": mask, "rewards": rewards, "gid": gid, "adv": adv,
            "logp_ref": token_logprobs(feats @ w_ref, tokens, temperature=0.7),
            "logp_behavior": token_logprobs(feats @ w_beh, tokens, temperature=0.7)}


def _params():
    g = torch.Generator().manual_seed(99)
    return torch.randn(H, V, generator=g).requires_grad_(), torch.zeros(len(GROUP_SIZES)).requires_grad_()


def _grads(case: str, rows: torch.Tensor | None, all_reduce=None, *, naive: bool = False):
    """Loss and (dW, dlogZ) on the given rows; with `all_reduce`, global normaliser and summed grads."""
    b, (w, z) = _batch(), _params()
    if rows is not None:
        b = {k: v[rows] for k, v in b.items()}
    cfg = make_config(**CASES[case])
    x = LossInputs(logp=token_logprobs(b["feats"] @ w, b["tokens"], temperature=0.7),
                   logp_ref=b["logp_ref"], logp_behavior=b["logp_behavior"], mask=b["mask"],
                   rewards=b["rewards"], group_ids=b["gid"], advantages=b["adv"], logz=z[b["gid"]])
    normalizer = None
    if all_reduce is not None and not naive:
        normalizer = all_reduce(loss_units(cfg, x))
    loss, _ = compute_loss(cfg, x, step=0, normalizer=normalizer)
    loss.backward()
    out = [loss.detach(), w.grad.clone(), z.grad.clone() if z.grad is not None else torch.zeros_like(z)]
    if all_reduce is not None:
        out = [all_reduce(o) for o in out]
        if naive:                                            # mean of per-rank means
            out = [o / dist.get_world_size() for o in out]
    return out


def _worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            return t

        gid = _batch()["gid"]
        rows = torch.isin(gid, torch.tensor(SHARDS[rank])).nonzero().squeeze(1)
        results = {case: _grads(case, rows, all_reduce) for case in CASES}
        results["naive_tb"] = _grads("tb", rows, all_reduce, naive=True)
        if rank == 0:
            torch.save(results, path)  # tensors: a file, not spawn_ranks' return value


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dist") / "grads.pt")
    spawn_ranks(_worker, 2, (2, free_ports(1)[0], path), timeout_s=120)
    return torch.load(path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_two_rank_gradient_equals_single_process(sharded, case):
    loss1, dw1, dz1 = _grads(case, None)
    loss2, dw2, dz2 = sharded[case]
    assert dw1.abs().max() > 0, "vacuous: the single-process gradient is zero"
    torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw2, dw1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dz2, dz1, rtol=1e-5, atol=1e-5)


def test_averaging_per_rank_means_is_not_invariant(sharded):
    # Control: uneven shards make the mean of per-rank means differ from the global mean.
    _, dw1, _ = _grads("tb", None)
    _, dw_naive, _ = sharded["naive_tb"]
    assert not torch.allclose(dw_naive, dw1, rtol=1e-3, atol=1e-3)
