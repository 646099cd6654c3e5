"""A-LoL's variants: hand-computed values and gradients, non-positive advantages, clipping in log
space, padding (split from test_losses.py; expected values worked out by hand in the comments)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_helpers import NAN, leaf, t

from hpc_tba.losses import alol

# -------------------------------------------------------------------------------------- A-LoL
# Two samples, two tokens. S = [-2, -4], S_ref = [-3, -3]: ρ = [e, e^-1]; ε = 0.9 → clip to
# [0.1, 1.9]: w = [1.9, e^-1]. A = [2, -1] → A+ = [2, 0].
AL_LOGP = [[-1.0, -1.0], [-2.0, -2.0]]
AL_REF = [[-1.5, -1.5], [-1.5, -1.5]]
AL_MASK = torch.ones(2, 2, dtype=torch.bool)
AL_ADV = t([2.0, -1.0])


@pytest.mark.parametrize("variant,expected_loss,grad_row0", [
    # a_lol:    ℓ0 = 1.9·2·2 = 7.6, ℓ1 = 0                 → loss 3.8; dℓ0/dlogp_t = −1.9·2
    ("a_lol", 3.8, -3.8),
    # ref_free: ℓ0 = 2·2 = 4                              → loss 2;   grad −2
    ("ref_free", 2.0, -2.0),
    # seq:      per-token ρ_t = e^{0.5} = 1.6487 (< 1.9);  ℓ0 = 2·Σ ρ_t·1 = 4e^{0.5}
    ("seq", 2 * math.exp(0.5), -2 * math.exp(0.5)),
    # kl (β=0.5): ℓ0 = 2·2 + 0.5·(−2 + 3) = 4.5; ℓ1 = 0 (A ≤ 0)  → 2.25; grad −2 + 0.5
    ("kl", 2.25, -1.5),
])
def test_alol_variants_hand_computed(variant, expected_loss, grad_row0):
    logp = leaf(AL_LOGP)
    loss, _ = alol(logp, t(AL_REF), AL_MASK, AL_ADV, variant=variant, kl_beta=0.5)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad[0], t([grad_row0 / 2] * 2))
    assert torch.all(logp.grad[1] == 0)                          # A = −1: never trained on


def test_alol_r_lol_uses_raw_rewards_including_negatives():
    logp = leaf(AL_LOGP)
    loss, _ = alol(logp, t(AL_REF), AL_MASK, AL_ADV, variant="r_lol")
    # ℓ0 = 1.9·2·2 = 7.6; ℓ1 = −e^-1·(−1)·(−4)... = w R NLL = e^-1·(−1)·4 = −4/e
    assert loss.item() == pytest.approx((7.6 - 4 / math.e) / 2, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad[1], t([math.exp(-1) / 2] * 2))


@settings(max_examples=30, deadline=None)
@given(adv=st.lists(st.floats(-5, 0), min_size=1, max_size=5),
       variant=st.sampled_from(["a_lol", "ref_free", "seq", "kl"]))
def test_alol_zero_gradient_for_non_positive_advantages(adv, variant):
    B = len(adv)
    g = torch.Generator().manual_seed(B)
    logp = (-3 * torch.rand(B, 4, generator=g)).requires_grad_()
    loss, _ = alol(logp, -3 * torch.rand(B, 4, generator=g), torch.ones(B, 4, dtype=torch.bool),
                   t(adv), variant=variant, kl_beta=0.3)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0)


def test_alol_weights_clipped_in_log_space_for_huge_ratios():
    logp = leaf([[-1.0], [-900.0]])
    ref = t([[-900.0], [-1.0]])                                  # log ρ = ±899
    loss, m = alol(logp, ref, torch.ones(2, 1, dtype=torch.bool), t([1.0, 1.0]))
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-1.9 / 2], [-0.1 / 2]]))
    assert m["alol/weight_clip_frac"].item() == 1.0


def test_alol_needs_reference_except_ref_free_and_padding():
    with pytest.raises(ValueError, match="ref_logp"):
        alol(t(AL_LOGP), None, AL_MASK, AL_ADV)
    logp = leaf([[-1.0, NAN]])
    loss, _ = alol(logp, t([[-1.0, NAN]]), torch.tensor([[True, False]]), t([1.0]), variant="seq")
    loss.backward()
    assert torch.isfinite(logp.grad).all() and loss.item() == pytest.approx(1.0)
