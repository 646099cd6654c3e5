"""A-LoL value head: pooling, fitting on synthetic data, freezing, advantages A = R − V(x)."""
from __future__ import annotations

import pytest
import torch

from hpc_tba.losses import alol
from hpc_tba.losses.value import (
    ValueHead,
    alol_advantages,
    fit_value_head,
    pool_prompt_hidden,
)


def _synthetic(n: int, seed: int, *, noise: float = 0.1):
    """Prompt states [n, 8]; reward = nonlinear function of two directions + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g) * 3.0 + 1.0            # unstandardised on purpose
    r = torch.tanh((x[:, 0] - 1.0) / 3.0) * 2.0 + 0.5 * ((x[:, 1] - 1.0) / 3.0) ** 2
    return x, r + noise * torch.randn(n, generator=g)


def test_pool_last_and_mean_with_left_and_right_padding():
    h = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    left = torch.tensor([[0, 1, 1], [1, 1, 1]])
    torch.testing.assert_close(pool_prompt_hidden(h, right), torch.tensor([[2.0, 3.0], [10.0, 11.0]]))
    torch.testing.assert_close(pool_prompt_hidden(h, left), torch.tensor([[4.0, 5.0], [10.0, 11.0]]))
    torch.testing.assert_close(pool_prompt_hidden(h, right, mode="mean"), torch.tensor([[1.0, 2.0], [8.0, 9.0]]))
    with pytest.raises(ValueError, match="attended"):
        pool_prompt_hidden(h, torch.zeros(2, 3))


def test_fit_explains_most_of_the_reward_variance_on_fresh_data():
    x, r = _synthetic(768, seed=0)
    head, m = fit_value_head(x, r, width=64, epochs=150, lr=3e-3, batch_size=128, seed=0)
    x_test, r_test = _synthetic(512, seed=1)
    with torch.no_grad():
        mse = (head(x_test) - r_test).pow(2).mean()
    # The noise floor is 0.01; predicting the mean would cost the reward variance (~1.3).
    assert mse < 0.1 * r_test.var()
    assert m["value/holdout_mse"] < 0.1 * m["value/reward_var"]


def test_linear_head_recovers_a_linear_value():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 4, generator=g)
    r = x @ torch.tensor([1.0, -2.0, 0.5, 0.0]) + 3.0
    head, _ = fit_value_head(x, r, depth=0, epochs=300, lr=3e-2, seed=0)
    torch.testing.assert_close(head(x), r, atol=0.05, rtol=0.0)


def test_head_is_frozen_deterministic_and_advantages_are_r_minus_v():
    x, r = _synthetic(64, seed=2)
    head, _ = fit_value_head(x, r, width=16, epochs=20, seed=3)
    again, _ = fit_value_head(x, r, width=16, epochs=20, seed=3)
    assert not head.training and all(not p.requires_grad for p in head.parameters())
    torch.testing.assert_close(head(x), again(x))
    adv = alol_advantages(head, x, r)
    torch.testing.assert_close(adv, r - head(x))
    assert not adv.requires_grad


def test_constant_reward_gives_zero_advantage():
    x = torch.randn(32, 3)
    head, _ = fit_value_head(x, torch.full((32,), 0.7), width=8, epochs=5)
    torch.testing.assert_close(alol_advantages(head, x, torch.full((32,), 0.7)), torch.zeros(32), atol=1e-5, rtol=0)


def test_fresh_head_predicts_the_mean_reward():
    x, r = _synthetic(100, seed=4)
    head = ValueHead(8, width=4, depth=1)
    head.set_statistics(x, r)
    torch.nn.init.zeros_(head.net[-1].weight)
    torch.nn.init.zeros_(head.net[-1].bias)
    torch.testing.assert_close(head(x), torch.full((100,), r.mean().item()))


def test_advantages_select_what_alol_trains_on():
    # Binary reward that depends on the prompt: V ≈ P(R=1|x); above-value samples get A > 0.
    g = torch.Generator().manual_seed(6)
    x = torch.randn(400, 4, generator=g)
    p = torch.sigmoid(2 * x[:, 0])
    r = (torch.rand(400, generator=g) < p).float()
    head, _ = fit_value_head(x, r, width=32, epochs=100, lr=3e-3, seed=0)
    assert (head(x) - p).pow(2).mean() < 0.02                   # close to the true P(R=1|x)
    adv = alol_advantages(head, x, r)
    assert (adv[r == 1] > 0).float().mean() > 0.8 and (adv[r == 0] < 0).float().mean() > 0.8
    logp = (-torch.rand(400, 3)).requires_grad_()
    loss, _ = alol(logp, -torch.rand(400, 3), torch.ones(400, 3, dtype=torch.bool), adv)
    loss.backward()
    assert torch.all(logp.grad[adv <= 0] == 0) and torch.all(logp.grad[adv > 0] < 0)


def test_fit_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        fit_value_head(torch.randn(5, 3), torch.randn(4))
    with pytest.raises(ValueError, match="at least 2"):
        fit_value_head(torch.randn(1, 3), torch.randn(1))
