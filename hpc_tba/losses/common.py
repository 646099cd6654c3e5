"""Shared pieces of the objectives: masked sums, group statistics, log-space ratios, normalisers.

Conventions every loss follows (see DESIGN.md "Losses are pure functions of tensors"):

- Per-token tensors are `[B, T]` over response tokens; `mask` is `[B, T]` bool, True on response
  tokens. Masked positions are selected out with `torch.where`, never multiplied by 0, so a -inf or
  NaN in padding cannot leak into the loss or its gradient.
- A row with no response token is padding: it carries no loss, is left out of group statistics
  (TB's logZ, GRPO/RLOO baselines, DPO pairs) and out of the default normaliser.
- The loss is `Σ_i ℓ_i / normalizer`. The default normaliser is the number of local non-empty rows
  (pairs for DPO), i.e. the per-sample mean. When a batch is split over data-parallel ranks, pass
  the GLOBAL count as `normalizer`: the per-rank losses then sum (all-reduce of gradients with SUM)
  to exactly the single-process loss. Every sample of a group must sit on the same rank.
- Group statistics use a dense `[B, B]` same-group matrix instead of `torch.unique`, so no
  host-device synchronisation is needed, and elementwise products instead of matmuls, so TF32
  cannot round rewards/β of a few hundred.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

# exp() of a log-ratio above this overflows nothing in fp32 (e^30 ≈ 1e13) and is already a
# meaningless ratio; it only guards logged statistics and GRPO's unclipped branch.
MAX_LOG_RATIO = 30.0


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Σ_t x[b, t] over mask[b, t]; `[B, T] -> [B]` in float32, or float64 for float64 input
    (padding values never read)."""
    return torch.where(mask, x.to(torch.promote_types(x.dtype, torch.float32)), 0.0).sum(dim=-1)


def row_lengths(mask: Tensor) -> Tensor:
    """Number of response tokens per row, `[B, T] -> [B]` float32."""
    return mask.sum(dim=-1).float()


def valid_rows(mask: Tensor) -> Tensor:
    """`[B]` bool: rows with at least one response token (the others are padding)."""
    return mask.any(dim=-1)


def resolve_normalizer(normalizer: float | Tensor | None, default: Tensor) -> Tensor | float:
    """The explicit normaliser, or `default` (a local count) clamped to >= 1 so empty batches give 0."""
    if normalizer is None:
        return default.float().clamp(min=1.0)
    if not isinstance(normalizer, Tensor) and normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    return normalizer


def reduce_loss(per_sample: Tensor, weight_rows: Tensor, normalizer: float | Tensor | None) -> Tensor:
    """Σ_i per_sample[i] over `weight_rows` (bool [B]) divided by the normaliser; a scalar tensor.

    `torch.where` keeps the result attached to the graph even when no row counts, so `backward()`
    still works (with a zero gradient) on an all-padding micro-batch.
    """
    norm = resolve_normalizer(normalizer, weight_rows.sum())
    return torch.where(weight_rows, per_sample, 0.0).sum() / norm


def same_group(group_ids: Tensor, valid: Tensor) -> Tensor:
    """`[B, B]` bool: `[i, j]` is True when j is a valid sample of i's group (prompt)."""
    return (group_ids[:, None] == group_ids[None, :]) & valid[None, :]


def group_sum(x: Tensor, same: Tensor) -> Tensor:
    """Per sample, the sum of x over the valid samples of its group: `[B] -> [B]`."""
    return torch.where(same, x[None, :], 0.0).sum(dim=-1)


def group_mean(x: Tensor, same: Tensor) -> tuple[Tensor, Tensor]:
    """Per sample, (mean of x over its group's valid samples, group size) — both `[B]`."""
    count = same.sum(dim=-1).float()
    return group_sum(x, same) / count.clamp(min=1.0), count


def group_std(x: Tensor, same: Tensor) -> Tensor:
    """Per sample, the unbiased std of x over its group (0 for groups of one): `[B] -> [B]`."""
    mean, count = group_mean(x, same)
    dev2 = torch.where(same, (x[None, :] - mean[:, None]) ** 2, 0.0).sum(dim=-1)
    return torch.sqrt(dev2 / (count - 1.0).clamp(min=1.0))


def log_clip_bounds(low: float, high: float) -> tuple[float, float]:
    """log(low), log(high) with log(0) = -inf and log(inf) = inf, for clipping ratios in log space."""
    if not (0.0 <= low <= high):
        raise ValueError(f"ratio clip range must satisfy 0 <= low <= high, got ({low}, {high})")

    def log(v: float) -> float:
        return -math.inf if v == 0 else math.log(v)  # math.log(inf) is inf

    return log(low), log(high)


def clipped_ratio(log_ratio: Tensor, low: float, high: float) -> Tensor:
    """Detached clip(exp(log_ratio), low, high) computed as exp(clip(log_ratio, log low, log high)).

    Clipping before the exponential is what keeps a sequence-level log-ratio of +200 from
    overflowing; with high = 1 this is TOPR's exp(min(Δ, 0)).
    """
    lo, hi = log_clip_bounds(low, high)
    return torch.exp(log_ratio.detach().clamp(min=lo, max=hi))


def ratio_metrics(logp: Tensor, logp_other: Tensor, mask: Tensor, prefix: str = "loss/ratio") -> dict[str, Tensor]:
    """Detached statistics of the sequence-level ratio exp(Σ logp − Σ logp_other) over valid rows.

    Reports `{prefix}_mean`, `_min`, `_max` (ratios, log-ratio capped at ±MAX_LOG_RATIO) and
    `{prefix}_log_mean` (mean sequence log-ratio; minus an estimate of KL(other‖current)).
    """
    with torch.no_grad():
        valid = valid_rows(mask)
        n = valid.sum().clamp(min=1)
        log_ratio = (masked_sum(logp, mask) - masked_sum(logp_other, mask)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio)
        return {
            f"{prefix}_mean": torch.where(valid, ratio, 0.0).sum() / n,
            f"{prefix}_min": torch.where(valid, ratio, math.inf).min() if ratio.numel() else ratio.new_zeros(()),
            f"{prefix}_max": torch.where(valid, ratio, 0.0).max() if ratio.numel() else ratio.new_zeros(()),
            f"{prefix}_log_mean": torch.where(valid, log_ratio, 0.0).sum() / n,
        }


def masked_mean_rows(x: Tensor, valid: Tensor) -> Tensor:
    """Detached mean of x `[B]` over valid rows (0 when none)."""
    with torch.no_grad():
        return torch.where(valid, x.detach().float(), 0.0).sum() / valid.sum().clamp(min=1)


def token_logprobs(logits: Tensor, targets: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log π(targets) from logits `[B, T, V]` at the sampling temperature: `[B, T]` float32.

    TBA takes log-probs of policy AND reference from `logits / T_gen` (ALGORITHMS.md §1), so
    the learner must use the temperature the searchers sampled at.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def check_shapes(logp: Tensor, mask: Tensor, tokens: tuple[Tensor | None, ...] = (),
                 samples: tuple[Tensor | None, ...] = ()) -> None:
    """Fail early, with the shapes, when tensors disagree (a silent broadcast is worse).

    `tokens` must be `[B, T]` like logp, `samples` `[B]`.
    """
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and mask {tuple(mask.shape)} must both be [B, T]")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    for t in tokens:
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"per-token tensor {tuple(t.shape)} does not match logp {tuple(logp.shape)}")
    for t in samples:
        if t is not None and t.shape != logp.shape[:1]:
            raise ValueError(f"per-sample tensor {tuple(t.shape)} must be [B] = [{logp.shape[0]}]")
