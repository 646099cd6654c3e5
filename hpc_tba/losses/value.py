"""A-LoL's value estimate V(x) and advantages A = R − V(x) (Baheti et al., ICLR 2024; ALGORITHMS.md §3).

The paper fits a small head on the FROZEN reference model's prompt representation, by mean-squared
error to the rewards of the reference model's own outputs on a validation split, then keeps it
fixed; each training example's advantage is computed once and stored with it (the buffer samples
A-LoL examples with probability ∝ A+).

Everything here is pure torch on tensors: the caller runs the reference model, pools its prompt
hidden states with `pool_prompt_hidden` into `[N, H]`, and passes them in with the rewards `[N]`
(several rewards per prompt are fine: the head then fits their mean). Inputs and targets are
standardised inside the head (statistics of the fitting data, kept as buffers), so a fresh head
predicts the mean reward and the learning rate does not depend on the reward scale.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def pool_prompt_hidden(hidden_states: Tensor, attention_mask: Tensor, *, mode: str = "last") -> Tensor:
    """Prompt representation `[N, L, H] -> [N, H]`: the last attended position, or the masked mean.

    "last" takes the highest index with attention_mask True, so left and right padding both work.
    """
    if hidden_states.dim() != 3 or attention_mask.shape != hidden_states.shape[:2]:
        raise ValueError(f"hidden_states {tuple(hidden_states.shape)} must be [N, L, H] and "
                         f"attention_mask {tuple(attention_mask.shape)} [N, L]")
    m = attention_mask.bool()
    if not m.any(dim=1).all():
        raise ValueError("every prompt needs at least one attended position")
    h = hidden_states.float()
    if mode == "last":
        pos = torch.arange(m.shape[1], device=m.device)
        last = torch.where(m, pos, -1).argmax(dim=1)                           # [N]
        return h[torch.arange(h.shape[0], device=h.device), last]
    if mode == "mean":
        return torch.where(m[..., None], h, 0.0).sum(1) / m.sum(1, keepdim=True)
    raise ValueError(f"mode={mode!r} is not 'last' or 'mean'")


class ValueHead(nn.Module):
    """V(x) = MLP(standardised prompt hidden state) · reward std + reward mean; `[N, H] -> [N]`."""

    def __init__(self, hidden_size: int, *, width: int = 256, depth: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = hidden_size
        for _ in range(depth):                                 # depth 0: a linear head
            layers += [nn.Linear(d, width), nn.GELU()]
            d = width
        layers.append(nn.Linear(d, 1))
        self.net = nn.Sequential(*layers)
        self.register_buffer("in_mean", torch.zeros(hidden_size))
        self.register_buffer("in_std", torch.ones(hidden_size))
        self.register_buffer("out_mean", torch.zeros(()))
        self.register_buffer("out_std", torch.ones(()))

    def set_statistics(self, hidden: Tensor, rewards: Tensor) -> None:
        """Standardise with the fitting data's statistics (std floored so constant features work)."""
        self.in_mean.copy_(hidden.mean(0))
        self.in_std.copy_(hidden.std(0, correction=0).clamp(min=1e-6))
        self.out_mean.copy_(rewards.mean())
        self.out_std.copy_(rewards.std(correction=0).clamp(min=1e-6))

    def forward(self, hidden: Tensor) -> Tensor:                 # [N, H] -> [N]
        z = (hidden.float() - self.in_mean) / self.in_std
        return self.net(z).squeeze(-1) * self.out_std + self.out_mean


def _mse(head: ValueHead, hidden: Tensor, rewards: Tensor) -> Tensor:
    with torch.no_grad():
        return (head(hidden) - rewards).pow(2).mean()


def fit_value_head(
    hidden: Tensor,
    rewards: Tensor,
    *,
    width: int = 256,
    depth: int = 1,
    epochs: int = 200,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    batch_size: int | None = None,
    holdout_fraction: float = 0.1,
    seed: int = 0,
) -> tuple[ValueHead, dict[str, Tensor]]:
    """Fit V(x) by MSE to `rewards [N]` from frozen prompt states `hidden [N, H]`; return it frozen.

    Adam on minibatches (`batch_size`, default full batch). A random `holdout_fraction` of the rows
    is held out; the head keeps the weights of the epoch with the lowest holdout MSE (early
    stopping). Deterministic for a given seed. Metrics: `value/train_mse`, `value/holdout_mse`,
    `value/reward_var` (the MSE of predicting the mean), `value/best_epoch`.
    """
    if hidden.dim() != 2 or rewards.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and rewards {tuple(rewards.shape)} [N]")
    n = hidden.shape[0]
    n_hold = round(n * holdout_fraction) if n >= 4 else 0
    if n - n_hold < 2:
        raise ValueError(f"need at least 2 training rows to fit a value head, got {n - n_hold}")
    g = torch.Generator().manual_seed(seed)
    hidden, rewards = hidden.detach().float().cpu(), rewards.detach().float().cpu()
    perm = torch.randperm(n, generator=g)
    hold, train = perm[:n_hold], perm[n_hold:]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = ValueHead(hidden.shape[1], width=width, depth=depth)
    head.set_statistics(hidden[train], rewards[train])
    opt = torch.optim.Adam(head.parameters(), lr=lr, weight_decay=weight_decay)
    bs = batch_size or len(train)
    check = hold if n_hold else train
    best = (_mse(head, hidden[check], rewards[check]), -1, {k: v.clone() for k, v in head.state_dict().items()})
    for epoch in range(epochs):
        order = train[torch.randperm(len(train), generator=g)]
        for i in range(0, len(order), bs):
            idx = order[i:i + bs]
            loss = (head(hidden[idx]) - rewards[idx]).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        mse = _mse(head, hidden[check], rewards[check])
        if mse < best[0]:
            best = (mse, epoch, {k: v.clone() for k, v in head.state_dict().items()})
    head.load_state_dict(best[2])
    head.eval().requires_grad_(False)
    metrics = {
        "value/train_mse": _mse(head, hidden[train], rewards[train]),
        "value/holdout_mse": best[0] if n_hold else torch.tensor(float("nan")),
        "value/reward_var": rewards[train].var(correction=0),
        "value/best_epoch": torch.tensor(float(best[1])),
    }
    return head, metrics


def alol_advantages(head: ValueHead, hidden: Tensor, rewards: Tensor) -> Tensor:
    """A = R − V(x) for each example, detached: `hidden [N, H]`, `rewards [N]` -> `[N]`.

    Computed once per training example and stored with it (not recomputed during training).
    """
    if hidden.dim() != 2 or rewards.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and rewards {tuple(rewards.shape)} [N]")
    with torch.no_grad():
        return rewards.float() - head(hidden.to(head.in_mean.device))
