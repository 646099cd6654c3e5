"""Baselines on the same machinery (ALGORITHMS.md §4): GRPO, RLOO, DPO, SFT.

GRPO (Shao et al., 2024, DeepSeekMath): A_i = (r_i − mean_g r) / (std_g r + eps) per prompt group;
per token ρ_t = exp(log π_θ − log μ) against the BEHAVIOUR policy, PPO surrogate
min(ρ_t A, clip(ρ_t, 1−ε, 1+ε) A), optional KL to the reference with the k3 estimator
exp(ref − logp) − (ref − logp) − 1; each sample averages over its tokens:
    ℓ_i = −(1/|y_i|) Σ_t [min(ρ_t A_i, clip(ρ_t) A_i) − kl_coef · k3_t]

RLOO (Ahmadian et al., 2024): leave-one-out baseline, sequence-level REINFORCE, optional
KL-shaped reward r' = r − kl_coef · sg[S − S_ref]:
    A_i = r'_i − mean_{j≠i in g} r'_j,     ℓ_i = −A_i · S_i  (/|y_i| when length_normalize)
No importance weights: it is on-policy (naive off-policy REINFORCE is a TOPR setting).

DPO (Rafailov et al., 2023) online/offline on groups of sampled responses: within a prompt group,
pairs (w, l) with r_w > r_l — 'best_worst' takes the highest against the lowest reward (ties go
to the lower batch index; groups with all-equal rewards give no pair), 'all' every ordered pair
with strictly different rewards. With h = S − S_ref:
    ℓ_(w,l) = −log σ(β (h_w − h_l)),   loss = Σ_pairs ℓ / normalizer (default: number of pairs)

SFT / rejection sampling: ℓ_i = −S_i (/|y_i|) on samples with r_i > min_reward.

Groups of one sample give GRPO and RLOO a zero advantage and DPO no pair.
"""
from __future__ import annotations

import torch
from torch import Tensor

from hpc_tba.losses.common import (
    MAX_LOG_RATIO,
    check_shapes,
    group_mean,
    group_std,
    group_sum,
    masked_mean_rows,
    masked_sum,
    reduce_loss,
    resolve_normalizer,
    row_lengths,
    same_group,
    valid_rows,
)


def grpo_advantages(rewards: Tensor, group_ids: Tensor, valid: Tensor, *, scale_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """Group-normalised advantages (r − mean_g) / (std_g + eps), 0 for padding rows: `[B]`."""
    same = same_group(group_ids, valid)
    r = rewards.detach().float()
    mean, _ = group_mean(r, same)
    adv = r - mean
    if scale_std:
        adv = adv / (group_std(r, same) + eps)
    return torch.where(valid, adv, 0.0)


def grpo(
    logp: Tensor,
    behavior_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    *,
    ref_logp: Tensor | None = None,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    scale_std: bool = True,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO loss (module docstring). Shapes: logp/behavior_logp/ref_logp/mask [B, T]; rewards, group_ids [B].

    Returns (loss, metrics) with `loss/grpo`, `grpo/clip_frac` (tokens whose ratio left
    [1−ε, 1+ε]), `grpo/kl_ref`, `grpo/adv_abs`.
    """
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("GRPO with kl_coef > 0 needs ref_logp")
    check_shapes(logp, mask, tokens=(behavior_logp, ref_logp), samples=(rewards, group_ids))
    valid = valid_rows(mask)                                              # [B]
    adv = grpo_advantages(rewards, group_ids, valid, scale_std=scale_std)[:, None]   # [B, 1]
    lp = torch.where(mask, logp.float(), 0.0)                             # [B, T], padding zeroed
    log_ratio = (lp - torch.where(mask, behavior_logp.detach().float(), 0.0)).clamp(max=MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)                                          # [B, T]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv)
    kl = torch.zeros_like(lp)
    if ref_logp is not None:
        d = (torch.where(mask, ref_logp.detach().float(), 0.0) - lp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl = torch.exp(d) - d - 1.0                                       # [B, T] k3 ≥ 0
    per_sample = -masked_sum(surrogate - kl_coef * kl, mask) / row_lengths(mask).clamp(min=1.0)
    loss = reduce_loss(per_sample, valid, normalizer)

    with torch.no_grad():
        n_tok = mask.sum().clamp(min=1)
        clipped = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)) & mask
        metrics = {
            "loss/grpo": loss.detach(),
            "grpo/clip_frac": clipped.sum() / n_tok,
            "grpo/kl_ref": torch.where(mask, kl, 0.0).sum() / n_tok,
            "grpo/adv_abs": masked_mean_rows(adv.squeeze(1).abs(), valid),
        }
    return loss, metrics


def rloo(
    logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    *,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    length_normalize: bool = False,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """RLOO loss (module docstring). Shapes: logp/ref_logp/mask [B, T]; rewards, group_ids [B].

    Returns (loss, metrics) with `loss/rloo`, `rloo/adv_abs`, `rloo/kl_ref` (mean S − S_ref).
    """
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("RLOO with kl_coef > 0 needs ref_logp")
    check_shapes(logp, mask, tokens=(ref_logp,), samples=(rewards, group_ids))
    valid = valid_rows(mask)
    s = masked_sum(logp, mask)                                            # [B]
    shaped = rewards.detach().float()
    kl_seq = None
    if ref_logp is not None:
        kl_seq = (s - masked_sum(ref_logp, mask)).detach()
        shaped = shaped - kl_coef * kl_seq
    same = same_group(group_ids, valid)
    count = same.sum(dim=-1).float()
    loo_mean = (group_sum(shaped, same) - shaped) / (count - 1.0).clamp(min=1.0)
    adv = torch.where(valid & (count > 1), shaped - loo_mean, 0.0)        # [B]
    per_sample = -adv * s
    if length_normalize:
        per_sample = per_sample / row_lengths(mask).clamp(min=1.0)
    loss = reduce_loss(per_sample, valid, normalizer)
    metrics = {"loss/rloo": loss.detach(), "rloo/adv_abs": masked_mean_rows(adv.abs(), valid)}
    if kl_seq is not None:
        metrics["rloo/kl_ref"] = masked_mean_rows(kl_seq, valid)
    return loss, metrics


def dpo_pairs(rewards: Tensor, group_ids: Tensor, valid: Tensor, *, pairing: str = "best_worst") -> Tensor:
    """`[B, B]` bool: `[w, l]` is True when (chosen w, rejected l) is a DPO pair (module docstring)."""
    r = rewards.detach().float()
    same = same_group(group_ids, valid) & valid[:, None]                  # [B, B]
    better = same & (r[:, None] > r[None, :])                             # [w, l]: r_w > r_l
    if pairing == "all":
        return better
    if pairing != "best_worst":
        raise ValueError(f"pairing={pairing!r} is not 'best_worst' or 'all'")
    idx = torch.arange(r.numel(), device=r.device)
    # i is its group's best if nobody in the group beats it and no tie sits at a lower index;
    # symmetrically for the worst.
    beats = same & ((r[None, :] > r[:, None]) | ((r[None, :] == r[:, None]) & (idx[None, :] < idx[:, None])))
    loses = same & ((r[None, :] < r[:, None]) | ((r[None, :] == r[:, None]) & (idx[None, :] < idx[:, None])))
    is_best = valid & ~beats.any(dim=-1)
    is_worst = valid & ~loses.any(dim=-1)
    return better & is_best[:, None] & is_worst[None, :]


def dpo(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    *,
    beta: float = 0.1,
    pairing: str = "best_worst",
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO on pairs formed inside prompt groups (module docstring). Shapes: [B, T] and [B].

    The default normaliser is the number of pairs (see `hpc_tba.losses.loss_units`).
    Returns (loss, metrics) with `loss/dpo`, `dpo/pairs`, `dpo/accuracy` (pairs with h_w > h_l),
    `dpo/margin` (mean β(h_w − h_l)).
    """
    check_shapes(logp, mask, tokens=(ref_logp,), samples=(rewards, group_ids))
    valid = valid_rows(mask)
    pairs = dpo_pairs(rewards, group_ids, valid, pairing=pairing)         # [B, B]
    h = masked_sum(logp, mask) - masked_sum(ref_logp.detach(), mask)      # [B] implicit reward / β
    margin = beta * (h[:, None] - h[None, :])                             # [B, B]
    per_pair = -torch.nn.functional.logsigmoid(margin)
    norm = resolve_normalizer(normalizer, pairs.sum())
    # torch.where keeps the graph (and a zero gradient) when there is no pair at all.
    loss = torch.where(pairs, per_pair, 0.0).sum() / norm

    with torch.no_grad():
        n = pairs.sum().clamp(min=1)
        metrics = {
            "loss/dpo": loss.detach(),
            "dpo/pairs": pairs.sum().float(),
            "dpo/accuracy": (pairs & (margin > 0)).sum() / n,
            "dpo/margin": torch.where(pairs, margin, 0.0).sum() / n,
        }
    return loss, metrics


def sft(
    logp: Tensor,
    mask: Tensor,
    rewards: Tensor | None = None,
    *,
    min_reward: float = 0.0,
    length_normalize: bool = False,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SFT / rejection sampling: −S on samples with reward > min_reward (all if rewards is None). [B, T], [B].

    Rows below the threshold give no loss but still count in the default normaliser (number of
    non-empty rows), so the loss scale follows the batch size, not the acceptance rate.
    Returns (loss, metrics) with `loss/sft`, `sft/kept_frac`, `sft/nll_per_token`.
    """
    check_shapes(logp, mask, samples=(rewards,))
    valid = valid_rows(mask)
    keep = valid if rewards is None else valid & (rewards.float() > min_reward)
    s = masked_sum(logp, mask)
    per_sample = -s / row_lengths(mask).clamp(min=1.0) if length_normalize else -s
    loss = reduce_loss(torch.where(keep, per_sample, 0.0), valid, normalizer)
    with torch.no_grad():
        metrics = {
            "loss/sft": loss.detach(),
            "sft/kept_frac": masked_mean_rows(keep.float(), valid),
            "sft/nll_per_token": torch.where(keep, -s, 0.0).sum() / torch.where(keep, row_lengths(mask), 0.0)
            .sum().clamp(min=1.0),
        }
    return loss, metrics
