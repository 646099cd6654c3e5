"""GRPO, RLOO, DPO and SFT: hand-computed values and gradients, groups of one, padding."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_helpers import NAN, leaf, t

from hpc_tba.losses import dpo, dpo_pairs, grpo, rloo, sft
from hpc_tba.losses.baselines import grpo_advantages

ONES = torch.ones(2, 2, dtype=torch.bool)


# --------------------------------------------------------------------------------------- GRPO
def test_grpo_advantages_group_normalised():
    # rewards [1, 0] in one group: mean 0.5, unbiased std √0.5 → A = ±1/√2; singleton → 0.
    a = grpo_advantages(t([1.0, 0.0, 5.0]), torch.tensor([0, 0, 1]), torch.ones(3, dtype=torch.bool))
    torch.testing.assert_close(a, t([1 / math.sqrt(2), -1 / math.sqrt(2), 0.0]), rtol=1e-5, atol=1e-5)
    a = grpo_advantages(t([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, dtype=torch.bool), scale_std=False)
    torch.testing.assert_close(a, t([0.5, -0.5]))


def test_grpo_on_policy_is_group_normalised_reinforce():
    logp = leaf([[-1.0, -2.0], [-0.5, -0.5]])
    loss, m = grpo(logp, logp.detach().clone(), ONES, t([1.0, 0.0]), torch.tensor([0, 0]))
    assert loss.item() == pytest.approx(0.0, abs=1e-6)          # Σ A = 0, ρ = 1
    loss.backward()
    a = 1 / math.sqrt(2)
    # dℓ_i/dlogp_t = −A_i ρ_t / |y| / B
    torch.testing.assert_close(logp.grad, t([[-a / 4] * 2, [a / 4] * 2]), rtol=1e-5, atol=1e-6)
    assert m["grpo/clip_frac"].item() == 0.0


def test_grpo_ppo_clipping():
    # Row 0: A > 0, ρ = 1.5 > 1.2 → clipped, no gradient. Row 1: A < 0, ρ = 0.5 < 0.8 → clipped,
    # no gradient. Rows 2/3 (second group): A_2 < 0 with ρ = 1.5 → the pessimistic unclipped term
    # 1.5·A is kept, gradient −A ρ / |y| / B; A_3 > 0 with ρ = 1 → plain.
    logp = leaf([[-1.0], [-1.0], [-1.0], [-1.0]])
    beh = t([[-1.0 - math.log(1.5)], [-1.0 + math.log(2.0)], [-1.0 - math.log(1.5)], [-1.0]])
    r = t([1.0, 0.0, 0.0, 1.0])
    loss, m = grpo(logp, beh, torch.ones(4, 1, dtype=torch.bool), r, torch.tensor([0, 0, 1, 1]))
    loss.backward()
    a = 1 / math.sqrt(2)
    torch.testing.assert_close(logp.grad, t([[0.0], [0.0], [a * 1.5 / 4], [-a / 4]]), rtol=1e-5, atol=1e-6)
    # loss = −(1.2a − 0.8a − 1.5a + a)/4
    assert loss.item() == pytest.approx(-(1.2 * a - 0.8 * a - 1.5 * a + a) / 4, rel=1e-5)
    assert m["grpo/clip_frac"].item() == pytest.approx(3 / 4)


def test_grpo_k3_kl_penalty():
    # Singleton group → A = 0, only the KL: d = ref − logp = −1, k3 = e^d − d − 1 = 1/e.
    logp = leaf([[-1.0, NAN]])
    mask = torch.tensor([[True, False]])
    loss, m = grpo(logp, t([[-1.0, NAN]]), mask, t([1.0]), torch.tensor([0]), ref_logp=t([[-2.0, NAN]]),
                   kl_coef=0.5)
    assert loss.item() == pytest.approx(0.5 / math.e)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[0.5 * (1 - 1 / math.e), 0.0]]))
    assert m["grpo/kl_ref"].item() == pytest.approx(1 / math.e)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo(logp, logp.detach(), mask, t([1.0]), torch.tensor([0]), kl_coef=0.1)


def test_grpo_huge_log_ratio_stays_finite():
    logp = leaf([[-1.0], [-1.0]])
    beh = t([[-500.0], [-500.0]])                               # log ρ = 499
    loss, _ = grpo(logp, beh, torch.ones(2, 1, dtype=torch.bool), t([1.0, 0.0]), torch.tensor([0, 0]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


# --------------------------------------------------------------------------------------- RLOO
def test_rloo_leave_one_out_hand_computed():
    # rewards [1, 0, 0.5]: A = [1 − 0.25, 0 − 0.75, 0.5 − 0.5] = [0.75, −0.75, 0]; S = [−2, −1, −3]
    # loss = Σ −A S / 3 = (1.5 − 0.75 + 0)/3 = 0.25; the singleton row 3 has A = 0.
    logp = leaf([[-1.0, -1.0], [-0.5, -0.5], [-1.5, -1.5], [-1.0, -1.0]])
    loss, m = rloo(logp, torch.ones(4, 2, dtype=torch.bool), t([1.0, 0.0, 0.5, 9.0]), torch.tensor([0, 0, 0, 1]))
    assert loss.item() == pytest.approx(0.75 / 4)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-0.75 / 4] * 2, [0.75 / 4] * 2, [0.0] * 2, [0.0] * 2]))
    assert m["rloo/adv_abs"].item() == pytest.approx(1.5 / 4)


def test_rloo_kl_shaped_reward_and_length_normalisation():
    # S − S_ref = [1, −1]; kl_coef 0.5 → r' = [1 − 0.5, 0 + 0.5] = [0.5, 0.5] → A = 0.
    logp = leaf([[-1.0, -1.0], [-2.0, -2.0]])
    ref = t([[-1.5, -1.5], [-1.5, -1.5]])
    loss, m = rloo(logp, ONES, t([1.0, 0.0]), torch.tensor([0, 0]), ref_logp=ref, kl_coef=0.5)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0)
    assert m["rloo/kl_ref"].item() == pytest.approx(0.0)
    # Without KL: A = [1, −1], S = [−2, −4]: Σ −A S/|y| / 2 = (1 − 2)/2
    ln, _ = rloo(logp, ONES, t([1.0, 0.0]), torch.tensor([0, 0]), length_normalize=True)
    assert ln.item() == pytest.approx(-0.5)


# ---------------------------------------------------------------------------------------- DPO
def test_dpo_pairs_best_worst_ties_and_all():
    r = t([1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 2])
    valid = torch.ones(6, dtype=torch.bool)
    bw = dpo_pairs(r, gid, valid)
    assert bw.nonzero().tolist() == [[0, 1]]                    # tie 0/2 → lower index; group 1 equal
    assert dpo_pairs(r, gid, valid, pairing="all").nonzero().tolist() == [[0, 1], [2, 1]]
    valid[0] = False                                            # a padding row is never paired
    assert dpo_pairs(r, gid, valid).nonzero().tolist() == [[2, 1]]


def test_dpo_hand_computed():
    # h = S − S_ref = [1, −1]; β = 0.5 → margin 1; loss = −log σ(1) = log(1 + e^-1).
    logp = leaf([[-1.0, -1.0], [-2.0, -2.0]])
    ref = t([[-1.5, -1.5], [-1.5, -1.5]])
    loss, m = dpo(logp, ref, ONES, t([1.0, 0.0]), torch.tensor([4, 4]), beta=0.5)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)))
    loss.backward()
    s = 1 / (1 + math.e)                                         # σ(−1)
    torch.testing.assert_close(logp.grad, t([[-0.5 * s] * 2, [0.5 * s] * 2]))
    assert m["dpo/accuracy"].item() == 1.0 and m["dpo/pairs"].item() == 1.0
    assert m["dpo/margin"].item() == pytest.approx(1.0)


def test_dpo_without_pairs_is_zero_and_backpropagates():
    logp = leaf([[-1.0, -1.0], [-2.0, -2.0]])
    loss, m = dpo(logp, t([[-1.0] * 2] * 2), ONES, t([1.0, 1.0]), torch.tensor([0, 0]))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0) and m["dpo/pairs"].item() == 0


# ---------------------------------------------------------------------------------------- SFT
def test_sft_rejection_sampling():
    logp = leaf([[-1.0, -2.0], [-3.0, NAN]])
    mask = torch.tensor([[True, True], [True, False]])
    loss, m = sft(logp, mask, t([1.0, 0.0]))                    # keeps row 0: −S = 3, over 2 rows
    assert loss.item() == pytest.approx(1.5)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-0.5, -0.5], [0.0, 0.0]]))
    assert m["sft/kept_frac"].item() == 0.5 and m["sft/nll_per_token"].item() == pytest.approx(1.5)
    all_rows, _ = sft(logp, mask, t([1.0, 0.0]), min_reward=float("-inf"), length_normalize=True)
    assert all_rows.item() == pytest.approx((1.5 + 3.0) / 2)


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_baselines_finite_for_any_grouping_with_padding(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    gid = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
    B = gid.numel()
    mask = torch.rand(B, 3, generator=g) > 0.4                   # some rows fully masked
    logp = torch.where(mask, -torch.rand(B, 3, generator=g), NAN).requires_grad_()
    ref = torch.where(mask, -torch.rand(B, 3, generator=g), NAN)
    r = (torch.rand(B, generator=g) > 0.5).float()
    for fn in (lambda: grpo(logp, ref, mask, r, gid, ref_logp=ref, kl_coef=0.1),
               lambda: rloo(logp, mask, r, gid, ref_logp=ref, kl_coef=0.1),
               lambda: dpo(logp, ref, mask, r, gid, pairing="all"),
               lambda: sft(logp, mask, r)):
        loss, m = fn()
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert torch.all(grad[~mask] == 0)
        assert all(torch.isfinite(v) for v in m.values())
