"""Trajectory balance (TBA, Bartoldson et al., 2025; ALGORITHMS.md §1).

Target: π*(y|x) ∝ π_ref(y|x) · exp(r(x, y)/β). With S = Σ_t log π_θ(y_t|x, y_<t) and S_ref the same
under the reference, the per-sample TB residual is

    δ_ij = logZ_i + S_ij − S_ref_ij − r_ij/β

VarGrad (the paper's default): logZ_i = sg[ mean_j (r_ij/β − S_ij + S_ref_ij) ] over the K samples
of prompt i under the CURRENT θ, so δ is the group-centred KL-shaped reward and

    L = (1/N) Σ δ²,        ∇L = −(2/(β N)) Σ A ∇S,    A = (r − β(S − S_ref)) − group mean

i.e. mean-baseline REINFORCE on the KL-shaped reward, scaled by 2/β. No importance weights and no
clipping: off-policy samples are used as they are (TB is a valid objective for any full-support
behaviour policy). The learned-logZ variant (classic GFlowNet TB) takes logZ from the caller — one
learnable scalar per prompt, or a small head — and lets the gradient flow into it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from hpc_tba.losses.common import (
    check_shapes,
    group_mean,
    masked_mean_rows,
    masked_sum,
    reduce_loss,
    same_group,
    valid_rows,
)


def trajectory_balance(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    beta: float,
    *,
    logz: Tensor | None = None,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Trajectory balance loss, VarGrad logZ by default.

    Args:
        logp: [B, T] per-token log π_θ (requires grad).
        ref_logp: [B, T] per-token log π_ref (no grad needed; detached here).
        mask: [B, T] bool, True on response tokens; applied identically to both policies.
        rewards: [B] sequence rewards.
        group_ids: [B] long, the prompt of each sample; logZ is estimated per group.
        beta: KL coefficient / reward temperature (> 0); rewards/β may be in the hundreds.
        logz: optional [B] learned logZ of each sample's prompt (gathered by the caller, with grad);
            when given it replaces the VarGrad estimate and receives gradient.
        normalizer: divide the summed per-sample loss by this (global sample count when sharded);
            default the number of non-empty local rows.

    Returns:
        (loss, metrics) with `loss/tb`, `tb/logZ` (mean over groups), `tb/beta`, `tb/residual_abs`,
        `tb/kl_ref` (mean S − S_ref), `tb/reward_over_beta`.
    """
    check_shapes(logp, mask, tokens=(ref_logp,), samples=(rewards, group_ids, logz))
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    valid = valid_rows(mask)                                      # [B]
    s = masked_sum(logp, mask)                                    # [B] Σ log π_θ
    s_ref = masked_sum(ref_logp.detach(), mask)                   # [B] Σ log π_ref
    r_beta = rewards.float() / beta                               # [B]
    same = same_group(group_ids, valid)                           # [B, B]
    if logz is None:
        logz_s, _ = group_mean((r_beta - s + s_ref).detach(), same)   # [B] sg[logZ] per sample
    else:
        logz_s = logz.float()
    resid = logz_s + s - s_ref - r_beta                           # [B] δ
    loss = reduce_loss(resid.pow(2), valid, normalizer)

    with torch.no_grad():
        # Mean of logZ over groups: weight each valid sample by 1/(its group size).
        count = same.sum(dim=-1).float().clamp(min=1.0)
        n_groups = torch.where(valid, 1.0 / count, 0.0).sum().clamp(min=1e-12)
        metrics = {
            "loss/tb": loss.detach(),
            "tb/logZ": torch.where(valid, logz_s.detach() / count, 0.0).sum() / n_groups,
            "tb/beta": s.new_tensor(float(beta)),
            "tb/residual_abs": masked_mean_rows(resid.abs(), valid),
            "tb/kl_ref": masked_mean_rows(s - s_ref, valid),
            "tb/reward_over_beta": masked_mean_rows(r_beta, valid),
        }
    return loss, metrics


def tb_advantages(logp: Tensor, ref_logp: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor,
                  beta: float) -> Tensor:
    """Detached KL-shaped, group-centred advantage A = (r − β(S − S_ref)) − group mean: `[B]`.

    On-policy, ∇ trajectory_balance = −(2/(β N)) Σ_i A_i ∇S_i (ALGORITHMS.md §1); the tests check it.
    """
    with torch.no_grad():
        valid = valid_rows(mask)
        shaped = rewards.float() - beta * (masked_sum(logp, mask) - masked_sum(ref_logp, mask))
        mean, _ = group_mean(shaped, same_group(group_ids, valid))
        return torch.where(valid, shaped - mean, 0.0)
