"""Trajectory balance, TOPR and the dispatcher: hand-computed values, gradient identities, edges (A-LoL's
variants: test_losses_alol.py).

Expected values are worked out by hand in the comments (small integers / halves), not by calling the
code under test a second time.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_helpers import INF, NAN, leaf, t

from hpc_tba.losses import (
    LossInputs,
    alol,
    compute_loss,
    loss_units,
    make_config,
    tb_advantages,
    token_logprobs,
    topr,
    trajectory_balance,
)
from hpc_tba.losses.registry import BUILTIN as ALGOS
from hpc_tba.losses.registry import config_class, needs

# ----------------------------------------------------------------------------------------- TB
# Batch used by several TB tests: groups [0, 0, 1], β = 0.5.
#   S    = [-3, -1, -3]     S_ref = [-2, -2, -2]     r/β = [2, 0, 2]
#   x = r/β − S + S_ref = [3, -1, 3];  logZ_0 = (3 − 1)/2 = 1, logZ_1 = 3
#   δ = logZ − x = [-2, 2, 0];  loss = (4 + 4 + 0)/3 = 8/3;  dL/dS_i = 2 δ_i / 3
TB_LOGP = [[-1.0, -2.0], [-0.5, -0.5], [-3.0, NAN]]
TB_REF = [[-1.0, -1.0], [-1.0, -1.0], [-2.0, NAN]]
TB_MASK = torch.tensor([[True, True], [True, True], [True, False]])
TB_R = t([1.0, 0.0, 1.0])
TB_G = torch.tensor([7, 7, 3])


def test_tb_hand_computed_value_gradient_and_metrics():
    logp = leaf(TB_LOGP)
    loss, m = trajectory_balance(logp, t(TB_REF), TB_MASK, TB_R, TB_G, 0.5)
    assert loss.item() == pytest.approx(8 / 3)
    loss.backward()
    expected = t([[-4 / 3, -4 / 3], [4 / 3, 4 / 3], [0.0, 0.0]])
    torch.testing.assert_close(logp.grad, expected)
    assert m["tb/logZ"].item() == pytest.approx(2.0)       # mean over the two groups of (1, 3)
    assert m["tb/beta"].item() == pytest.approx(0.5)
    assert m["loss/tb"].item() == pytest.approx(8 / 3)
    assert m["tb/residual_abs"].item() == pytest.approx(4 / 3)
    assert all(not v.requires_grad for v in m.values())


def test_tb_explicit_normalizer_scales_loss():
    loss, _ = trajectory_balance(t(TB_LOGP), t(TB_REF), TB_MASK, TB_R, TB_G, 0.5, normalizer=8.0)
    assert loss.item() == pytest.approx(8 / 8)             # Σ δ² = 8


def test_tb_groups_of_one_give_zero_loss_and_gradient():
    logp = leaf(TB_LOGP)
    loss, _ = trajectory_balance(logp, t(TB_REF), TB_MASK, TB_R, torch.tensor([0, 1, 2]), 0.5)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(logp.grad == 0)


def test_tb_padding_rows_are_ignored_even_with_nan():
    # Append a fully masked row full of NaN / -inf to the hand-computed batch, in group 7.
    logp = leaf(TB_LOGP + [[NAN, -INF]])
    mask = torch.cat([TB_MASK, torch.tensor([[False, False]])])
    loss, m = trajectory_balance(logp, t(TB_REF + [[NAN, NAN]]), mask, torch.cat([TB_R, t([1e6])]),
                                 torch.cat([TB_G, torch.tensor([7])]), 0.5)
    assert loss.item() == pytest.approx(8 / 3)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and torch.all(logp.grad[3] == 0)
    assert m["tb/logZ"].item() == pytest.approx(2.0)


def test_tb_all_padding_batch_is_zero_and_backpropagates():
    logp = leaf([[NAN, NAN], [-1.0, -1.0]])
    loss, m = trajectory_balance(logp, t([[0.0, 0.0]] * 2), torch.zeros(2, 2, dtype=torch.bool),
                                 t([1.0, 0.0]), torch.tensor([0, 0]), 0.004)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0)
    assert all(torch.isfinite(v) for v in m.values())


def test_tb_large_reward_over_beta_matches_float64():
    # β = 0.004 turns a 0/1 reward into 0/250; sequences of 400 tokens sum to about −400.
    g = torch.Generator().manual_seed(0)
    B, T, beta = 8, 400, 0.004
    logp = (-2 * torch.rand(B, T, generator=g)).requires_grad_()
    ref = -2 * torch.rand(B, T, generator=g)
    r = (torch.rand(B, generator=g) > 0.5).float()
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(B, T, dtype=torch.bool)
    loss, _ = trajectory_balance(logp, ref, mask, r, gid, beta)
    loss.backward()
    # Reference in float64 by the formula.
    x = r.double() / beta - logp.detach().double().sum(1) + ref.double().sum(1)
    logz = torch.stack([x[gid == k].mean() for k in gid.tolist()])
    delta = logz - x
    assert loss.item() == pytest.approx((delta ** 2).mean().item(), rel=1e-5)
    torch.testing.assert_close(logp.grad.double(), (2 * delta / B)[:, None].expand(B, T), rtol=1e-4, atol=1e-4)


def _softmax_policy(seed: int, B: int, T: int, V: int = 7):
    """A tiny differentiable policy: logits = features @ W, plus sampled tokens and a mask."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(B, T, 5, generator=g)
    W = torch.randn(5, V, generator=g).requires_grad_()
    tokens = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return feats, W, tokens, mask


def test_tb_gradient_is_kl_shaped_reinforce():
    # ∇L_TB = −(2/(β N)) Σ_i A_i ∇S_i, A = (r − β(S − S_ref)) − group mean (ALGORITHMS.md §1).
    B, T, beta = 12, 6, 0.05
    feats, W, tokens, mask = _softmax_policy(1, B, T)
    logp = token_logprobs(feats @ W, tokens, temperature=0.7)
    ref = token_logprobs(feats @ torch.randn(5, 7), tokens, temperature=0.7)
    r = (torch.arange(B) % 3 == 0).float()
    gid = torch.arange(B) // 4                                  # 3 prompts × K = 4
    loss, _ = trajectory_balance(logp, ref, mask, r, gid, beta)
    (g_tb,) = torch.autograd.grad(loss, W, retain_graph=True)
    adv = tb_advantages(logp, ref, mask, r, gid, beta)
    s = torch.where(mask, logp, 0.0).sum(1)
    (g_pg,) = torch.autograd.grad(-(2 / (beta * B)) * (adv * s).sum(), W)
    torch.testing.assert_close(g_tb, g_pg, rtol=1e-4, atol=1e-5)
    assert g_tb.abs().max() > 1e-3                               # not a vacuous 0 == 0


def test_tb_learned_logz_gets_gradient_and_matches_vargrad_at_the_estimate():
    logz = leaf([1.0, 1.0, 3.0])                                 # the VarGrad values of the hand batch
    logp = leaf(TB_LOGP)
    loss, m = trajectory_balance(logp, t(TB_REF), TB_MASK, TB_R, TB_G, 0.5, logz=logz)
    assert loss.item() == pytest.approx(8 / 3)
    loss.backward()
    torch.testing.assert_close(logz.grad, t([-4 / 3, 4 / 3, 0.0]))   # 2 δ / 3
    assert m["tb/logZ"].item() == pytest.approx(2.0)


@settings(max_examples=25, deadline=None)
@given(perm_seed=st.integers(0, 10_000), beta=st.floats(0.004, 2.0))
def test_tb_is_invariant_to_batch_order(perm_seed, beta):
    g = torch.Generator().manual_seed(perm_seed)
    logp, ref = -torch.rand(6, 4, generator=g), -torch.rand(6, 4, generator=g)
    mask = torch.rand(6, 4, generator=g) > 0.3
    r, gid = torch.rand(6, generator=g), torch.tensor([5, 1, 5, 1, 9, 5])
    perm = torch.randperm(6, generator=g)
    a, _ = trajectory_balance(logp, ref, mask, r, gid, beta)
    b, _ = trajectory_balance(logp[perm], ref[perm], mask[perm], r[perm], gid[perm], beta)
    assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-5)


def test_tb_rejects_bad_shapes_and_beta():
    with pytest.raises(ValueError, match="beta"):
        trajectory_balance(t(TB_LOGP), t(TB_REF), TB_MASK, TB_R, TB_G, 0.0)
    with pytest.raises(ValueError, match=r"\[B\]"):
        trajectory_balance(t(TB_LOGP), t(TB_REF), TB_MASK, TB_R[:2], TB_G, 0.5)
    with pytest.raises(ValueError, match="mask"):
        trajectory_balance(t(TB_LOGP), t(TB_REF), TB_MASK.float(), TB_R, TB_G, 0.5)


# --------------------------------------------------------------------------------------- TOPR
def test_topr_hand_computed():
    # Two tokens each; S = [-2, -4, -1]; Δ = S − S_μ = [-1, 2, -ln 4... see below].
    logp = leaf([[-1.0, -1.0], [-2.0, -2.0], [-0.5, -0.5]])
    beh = t([[-0.5, -0.5], [-3.0, -3.0], [-0.5 + math.log(4) / 2] * 2])   # Δ = [-1, 2, -ln 4]
    mask = torch.ones(3, 2, dtype=torch.bool)
    r = t([1.0, -1.0, -1.0])
    # weights: positive → 1; negative Δ=2 → min(e², 1) = 1; negative Δ=−ln4 → 1/4.
    # ℓ = −w R S / |y| = [−(1)(1)(−2)/2, −(1)(−1)(−4)/2, −(1/4)(−1)(−1)/2] = [1, −2, −1/8]
    loss, m = topr(logp, beh, mask, r)
    assert loss.item() == pytest.approx((1 - 2 - 0.125) / 3)
    loss.backward()
    # dℓ/dlogp_t = −w R / |y| / B
    torch.testing.assert_close(logp.grad, t([[-1 / 6] * 2, [1 / 6] * 2, [1 / 24] * 2]))
    assert m["topr/weight_neg"].item() == pytest.approx((1 + 0.25) / 2)
    assert m["topr/pos_frac"].item() == pytest.approx(1 / 3)


def test_topr_positive_weight_is_exactly_one_far_off_policy():
    # Δ = S − S_μ = +80, −80, +400, −400 (exp would overflow at 400): the positives' gradient must
    # still be exactly −R/|y|/B.
    logp = leaf([[-100.0, -100.0, -100.0]] * 4)                 # S = −300
    deltas = t([80.0, -80.0, 400.0, -400.0])
    beh = ((-300.0 - deltas) / 3)[:, None].expand(4, 3)
    loss, m = topr(logp, beh, torch.ones(4, 3, dtype=torch.bool), t([1.0, 1.0, 1.0, 1.0]))
    loss.backward()
    assert torch.all(logp.grad == -1.0 / 3 / 4)
    assert m["topr/weight_pos"].item() == 1.0


def test_topr_negative_weight_is_exp_min_delta_zero_without_overflow():
    logp = leaf([[-1.0], [-1.0], [-1.0]])
    beh = t([[-500.0], [-1.0 + 3.0], [-1.0]])                    # Δ = 499, −3, 0
    loss, _ = topr(logp, beh, torch.ones(3, 1, dtype=torch.bool), t([-1.0, -1.0, -1.0]))
    loss.backward()
    # dℓ/dlogp = −w R / B = w / 3 with w = [1, e^-3, 1]
    torch.testing.assert_close(logp.grad, t([[1 / 3], [math.exp(-3) / 3], [1 / 3]]))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name,pos_clip,neg_clip,w_pos,w_neg", [
    ("topr", (1.0, 1.0), (0.0, 1.0), 1.0, math.exp(-1)),      # Δ_neg = −1 → e^-1; Δ_pos = +2 → 1
    ("tis", (0.0, 1.0), (0.0, 1.0), 1.0, math.exp(-1)),       # positive Δ=+2 truncated at 1
    ("reinforce", (1.0, 1.0), (1.0, 1.0), 1.0, 1.0),
    ("sft_pos", (1.0, 1.0), (0.0, 0.0), 1.0, 0.0),
    ("untruncated_is", (0.0, INF), (0.0, INF), math.exp(2), math.exp(-1)),
])
def test_topr_family_settings(name, pos_clip, neg_clip, w_pos, w_neg):
    logp = leaf([[-1.0], [-1.0]])
    beh = t([[-3.0], [0.0]])                                     # Δ = [+2, −1]
    loss, _ = topr(logp, beh, torch.ones(2, 1, dtype=torch.bool), t([1.0, -1.0]),
                   pos_clip=pos_clip, neg_clip=neg_clip)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([[-w_pos / 2], [w_neg / 2]]))


def test_topr_sft_setting_ignores_nan_negatives():
    logp = leaf([[-1.0], [-INF]])                                # a negative with an impossible token
    loss, _ = topr(logp, t([[-1.0], [-1.0]]), torch.ones(2, 1, dtype=torch.bool), t([1.0, -1.0]),
                   neg_clip=(0.0, 0.0))
    loss.backward()
    assert loss.item() == pytest.approx(0.5) and torch.isfinite(logp.grad).all()


def test_topr_baseline_length_normalisation_and_threshold():
    logp = leaf([[-1.0, -1.0, -1.0], [-2.0, -2.0, NAN]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    beh = t([[-1.0] * 3, [-2.0, -2.0, 0.0]])                     # on-policy: ρ = 1
    r = t([1.0, 0.0])
    # 0/1 rewards with threshold 0.5 and baseline 0.5: ℓ = −(±0.5) S / |y| = [−0.5·(−3)/3, 0.5·(−4)/2]
    loss, _ = topr(logp, beh, mask, r, baseline=0.5, positive_threshold=0.5)
    assert loss.item() == pytest.approx((0.5 - 1.0) / 2)
    loss_sum, _ = topr(logp, beh, mask, r, baseline=0.5, positive_threshold=0.5, length_normalize=False)
    assert loss_sum.item() == pytest.approx((1.5 - 2.0) / 2)
    with pytest.raises(ValueError, match="low <= high"):
        topr(logp, beh, mask, r, neg_clip=(1.0, 0.5))


# ---------------------------------------------------------------------- dispatcher and config
def _inputs(*, with_ref=True, advantages=True, logz=False) -> LossInputs:
    g = torch.Generator().manual_seed(3)
    B, T = 6, 5
    logp = (-torch.rand(B, T, generator=g)).requires_grad_()
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    return LossInputs(
        logp=logp, logp_ref=-torch.rand(B, T, generator=g) if with_ref else None,
        logp_behavior=-torch.rand(B, T, generator=g), mask=mask,
        rewards=t([1.0, 0.0, 1.0, 0.0, 1.0, 1.0]), group_ids=torch.tensor([0, 0, 0, 1, 1, 2]),
        advantages=t([0.5, -0.5, 0.2, -0.1, 0.3, 0.0]) if advantages else None,
        logz=torch.zeros(B, requires_grad=True) if logz else None)


@pytest.mark.parametrize("name", ALGOS)
def test_compute_loss_dispatches_every_algo(name):
    cfg = make_config(name=name)
    x = _inputs()
    loss, m = compute_loss(cfg, x, step=0)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert x.logp.grad is not None and torch.isfinite(x.logp.grad).all()
    assert m[f"loss/{name}"].item() == pytest.approx(loss.item())
    for key in ("loss/ratio_mean", "loss/ratio_log_mean", "loss/reward_mean", "loss/total"):
        assert key in m and not m[key].requires_grad
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in m.values())


def test_compute_loss_tb_uses_beta_schedule_and_learned_logz():
    cfg = make_config(name="tb", beta0=1.0, beta_final=0.5, beta_steps=10)
    x = _inputs()
    _, m = compute_loss(cfg, x, step=5)
    assert m["tb/beta"].item() == pytest.approx(0.75)
    direct, _ = trajectory_balance(x.logp, x.logp_ref, x.mask, x.rewards, x.group_ids, 0.75)
    assert m["loss/tb"].item() == pytest.approx(direct.item())
    with pytest.raises(ValueError, match="logz"):
        compute_loss(make_config(tb_logz="learned"), x, step=0)
    xl = _inputs(logz=True)
    loss, _ = compute_loss(make_config(tb_logz="learned"), xl, step=0)
    loss.backward()
    assert xl.logz.grad is not None and xl.logz.grad.abs().sum() > 0


def test_compute_loss_matches_the_functions_it_dispatches_to():
    x = _inputs()
    got, _ = compute_loss(make_config(name="topr", topr_neg_max=2.0), x, step=0)
    want, _ = topr(x.logp, x.logp_behavior, x.mask, x.rewards, neg_clip=(0.0, 2.0))
    assert got.item() == pytest.approx(want.item())
    got, _ = compute_loss(make_config(name="alol", alol_variant="r_lol"), x, step=0, normalizer=3.0)
    want, _ = alol(x.logp, x.logp_ref, x.mask, x.rewards, variant="r_lol", normalizer=3.0)
    assert got.item() == pytest.approx(want.item())


def test_needs_reference_matches_what_compute_loss_reads():
    expected = {"tb": True, "topr": False, "alol": True, "grpo": False, "rloo": False, "dpo": True,
                "sft": False}
    for name, want in expected.items():
        cfg = make_config(name=name)
        assert needs(cfg).reference is want, name
        if not want:   # must run without a reference
            compute_loss(cfg, _inputs(with_ref=False), step=0)
        else:
            with pytest.raises(ValueError, match="logp_ref"):
                compute_loss(cfg, _inputs(with_ref=False), step=0)
    assert needs(make_config(name="grpo", kl_coef=0.04)).reference
    assert needs(make_config(name="rloo", kl_coef=0.1)).reference
    assert not needs(make_config(name="alol", alol_variant="ref_free")).reference
    compute_loss(make_config(name="alol", alol_variant="ref_free"), _inputs(with_ref=False), step=0)
    assert needs(make_config(name="alol")).advantages
    assert not needs(make_config(name="alol", alol_variant="r_lol")).advantages
    with pytest.raises(ValueError, match="advantages"):
        compute_loss(make_config(name="alol"), _inputs(advantages=False), step=0)


def test_loss_units_counts_rows_or_pairs():
    x = _inputs()
    assert loss_units(make_config(name="tb"), x).item() == 6
    assert loss_units(make_config(name="dpo"), x).item() == 2    # groups 0 and 1 have distinct rewards
    padded = dataclasses.replace(x, mask=torch.zeros_like(x.mask))
    assert loss_units(make_config(name="grpo"), padded).item() == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"name": "ppo"}, "algo.name"),
    ({"beta0": 0.0}, "beta0"),
    ({"tb_logz": "table"}, "tb_logz"),
    ({"name": "topr", "topr_neg_min": 2.0}, "topr_neg_min"),
    ({"name": "alol", "alol_variant": "alol"}, "alol_variant"),
    ({"name": "alol", "alol_clip_eps": 1.0}, "alol_clip_eps"),
    ({"name": "alol", "alol_variant": "kl"}, "alol_kl_beta"),
    ({"name": "grpo", "grpo_clip_eps": 0.0}, "grpo_clip_eps"),
    ({"name": "grpo", "kl_coef": -1.0}, "kl_coef"),
    ({"name": "rloo", "kl_coef": -1.0}, "kl_coef"),
    ({"name": "dpo", "dpo_beta": 0.0}, "dpo_beta"),
    ({"name": "dpo", "dpo_pairing": "random"}, "dpo_pairing"),
    ({"name": "sft", "sft_min_reward": NAN}, "sft_min_reward"),
    ({"reward_map": "pm2"}, "reward_map"),
    ({"name": "tb", "topr_neg_min": 0.0}, "unknown config key 'algo.topr_neg_min'"),  # another objective's field
])
def test_config_validation_messages(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_config(**kwargs)


def test_beta_schedule():
    cfg = make_config(beta0=0.012, beta_final=0.004, beta_steps=500)
    assert cfg.beta(0) == pytest.approx(0.012)
    assert cfg.beta(250) == pytest.approx(0.008)
    assert cfg.beta(500) == cfg.beta(10_000) == pytest.approx(0.004)
    assert make_config(beta_steps=0).beta(0) == pytest.approx(0.004)


def test_algo_yamls_mirror_the_dataclass():
    # Every yaml composes onto its objective's config class (unknown keys would fail) and sets its own name.
    from hpc_tba.assembly.compose import compose
    for name in ALGOS:
        cfg = compose([f"algo={name}"]).algo
        assert type(cfg) is config_class(name) and cfg.name == name
    assert compose(["algo=grpo"]).algo.kl_coef == pytest.approx(0.04)
    assert compose(["algo=alol"]).algo.alol_clip_eps == pytest.approx(0.9)
    assert compose(["algo=topr"]).algo.topr_neg_min == 0.0


def test_token_logprobs_uses_the_temperature():
    logits = t([[[0.0, math.log(3.0)]]])                         # [1, 1, 2]
    lp = token_logprobs(logits, torch.tensor([[1]]), temperature=1.0)
    assert lp.item() == pytest.approx(math.log(3 / 4))
    lp_half = token_logprobs(logits, torch.tensor([[1]]), temperature=0.5)   # logits ×2: 9 / 10
    assert lp_half.item() == pytest.approx(math.log(9 / 10))


CONFIG_VARIANTS = [
    {"name": "tb"}, {"name": "tb", "tb_logz": "learned"}, {"name": "topr"},
    *({"name": "alol", "alol_variant": v, "alol_kl_beta": 0.1} for v in ("a_lol", "ref_free", "seq", "kl", "r_lol")),
    {"name": "grpo", "kl_coef": 0.04}, {"name": "rloo", "kl_coef": 0.1}, {"name": "dpo"},
    {"name": "dpo", "dpo_pairing": "all"}, {"name": "sft"},
]


@pytest.mark.parametrize("kwargs", CONFIG_VARIANTS, ids=lambda k: "-".join(map(str, k.values())))
def test_losses_run_on_the_meta_device(kwargs):
    # Meta tensors have no data: any .item(), host sync or data-dependent shape (nonzero, unique,
    # boolean indexing) raises, and a metric created on the CPU shows up with the wrong device.
    B, T = 6, 5
    e = lambda *s, **kw: torch.empty(*s, device="meta", **kw)
    x = LossInputs(logp=e(B, T).requires_grad_(), logp_ref=e(B, T), logp_behavior=e(B, T),
                   mask=e(B, T, dtype=torch.bool), rewards=e(B), group_ids=e(B, dtype=torch.long),
                   advantages=e(B), logz=e(B).requires_grad_())
    cfg = make_config(**kwargs)
    loss, m = compute_loss(cfg, x, step=3, normalizer=loss_units(cfg, x))
    loss.backward()
    assert loss.device.type == "meta" and loss.shape == ()
    assert {v.device.type for v in m.values()} == {"meta"}


def test_loss_sources_hold_no_collectives_or_item():
    import ast
    import pathlib

    import hpc_tba.losses as pkg
    for path in pathlib.Path(pkg.__file__).parent.rglob("*.py"):  # objectives/ too
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("item", "tolist", "distributed"), f"{path.name}:{node.lineno}"
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
                assert not any("distributed" in n for n in names), f"{path.name}:{node.lineno}"


def test_bfloat16_log_probs_are_summed_in_float32():
    x = _inputs()
    lp16 = x.logp.detach().to(torch.bfloat16).requires_grad_()
    x16 = dataclasses.replace(x, logp=lp16)
    for name in ALGOS:
        l32, _ = compute_loss(make_config(name=name), dataclasses.replace(x, logp=lp16.detach().float()), step=0)
        l16, _ = compute_loss(make_config(name=name), x16, step=0)
        assert l16.dtype == torch.float32
        assert l16.item() == pytest.approx(l32.item(), rel=1e-5, abs=1e-6), name
