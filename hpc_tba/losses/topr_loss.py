"""Tapered Off-Policy REINFORCE (TOPR, Le Roux et al., 2025; ALGORITHMS.md §2).

    Δ  = S − S_μ = Σ_t (log π_θ − log μ)               sequence-level log-ratio
    α  = sg[clip(exp Δ, a+, b+)]   if R ≥ 0              computed as exp(clip(Δ, log a, log b))
    α  = sg[clip(exp Δ, a−, b−)]   if R < 0
    ℓ  = −α · (R − c) · S / |y|                          (/|y| when length_normalize)

The split into positives and negatives uses the reward R it is given (R ≥ positive_threshold, 0
by default); the baseline c only shifts the multiplier (R − c). With 0/1 task rewards and c = 0 a
wrong answer would get R − c = 0, i.e. no weight at all (rejection-sampling SFT, not TOPR), so
the dispatcher passes `ToprConfig.topr_rewards(R)` (objectives/topr.py): under
algo.reward_map=pm1 (what `auto` picks for a 0/1 task) the task's declared [low, high] maps to
the paper's ±1. One function covers the family (pos_clip = (a+, b+), neg_clip = (a−, b−)):

| setting                     | pos_clip    | neg_clip    |
|-----------------------------|-------------|-------------|
| TOPR (default)              | (1, 1)      | (0, 1)      |
| truncated IS (TIS)          | (0, 1)      | (0, 1)      |
| naive off-policy REINFORCE  | (1, 1)      | (1, 1)      |
| SFT on positives only       | (1, 1)      | (0, 0)      |
| untruncated IS              | (0, inf)    | (0, inf)    |

With an upper clip of 1 the weight is exp(min(Δ, 0)): no overflow however stale μ is. No KL term
and no reference model.
"""
from __future__ import annotations

import torch
from torch import Tensor

from hpc_tba.losses.common import (
    check_shapes,
    clipped_ratio,
    masked_mean_rows,
    masked_sum,
    reduce_loss,
    row_lengths,
    valid_rows,
)


def topr(
    logp: Tensor,
    behavior_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    *,
    baseline: float = 0.0,
    pos_clip: tuple[float, float] = (1.0, 1.0),
    neg_clip: tuple[float, float] = (0.0, 1.0),
    length_normalize: bool = True,
    positive_threshold: float = 0.0,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """TOPR loss and its family (TIS, naive REINFORCE, SFT-on-positives; see module docstring).

    Args:
        logp: [B, T] per-token log π_θ (requires grad).
        behavior_logp: [B, T] per-token log μ of the policy that sampled the response.
        mask: [B, T] bool response tokens.
        rewards: [B] rewards (TOPR's paper: ±1); R ≥ positive_threshold is a positive.
        baseline: c, subtracted from the reward in the multiplier.
        pos_clip / neg_clip: (low, high) clip of the sequence ratio for positives / negatives.
        length_normalize: divide each sample's loss by its number of response tokens.
        positive_threshold: rewards at or above it are positives (0 for ±1 rewards; with 0/1
            rewards use 0.5 together with baseline=0.5, which is ±1 TOPR scaled by 1/2).
        normalizer: divide the summed loss by this; default the number of non-empty rows.

    Returns:
        (loss, metrics) with `loss/topr`, `topr/pos_frac`, `topr/weight_pos`, `topr/weight_neg`
        (mean weights), `topr/multiplier_pos` / `topr/multiplier_neg` (mean R − c: the reward
        mapping as trained on), `topr/neg_tapered_frac` (negatives with weight < 1).
    """
    check_shapes(logp, mask, tokens=(behavior_logp,), samples=(rewards,))
    valid = valid_rows(mask)                                          # [B]
    s = masked_sum(logp, mask)                                        # [B] S
    delta = s - masked_sum(behavior_logp.detach(), mask)              # [B] Δ, log space
    pos = rewards >= positive_threshold                                                # [B]
    weight = torch.where(pos, clipped_ratio(delta, *pos_clip), clipped_ratio(delta, *neg_clip))  # [B] detached
    per_sample = -weight * (rewards.float() - baseline) * s           # [B]
    if length_normalize:
        per_sample = per_sample / row_lengths(mask).clamp(min=1.0)
    # A weight of exactly 0 must not turn an inf log-prob into NaN: drop those rows outright.
    loss = reduce_loss(torch.where(weight > 0, per_sample, 0.0), valid, normalizer)

    with torch.no_grad():
        vpos, vneg = valid & pos, valid & ~pos
        multiplier = rewards.float() - baseline  # [B] R − c: > 0 pushes a sample up, < 0 down
        metrics = {
            "topr/multiplier_pos": masked_mean_rows(multiplier, vpos),
            "topr/multiplier_neg": masked_mean_rows(multiplier, vneg),
            "loss/topr": loss.detach(),
            "topr/pos_frac": masked_mean_rows(pos.float(), valid),
            "topr/weight_pos": masked_mean_rows(weight, vpos),
            "topr/weight_neg": masked_mean_rows(weight, vneg),
            "topr/neg_tapered_frac": masked_mean_rows((weight < 1).float(), vneg),
        }
    return loss, metrics
