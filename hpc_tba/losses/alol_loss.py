"""Advantage-Leftover-Lunch RL (A-LoL, Baheti et al., ICLR 2024; ALGORITHMS.md §3).

The whole response is one action. With S = Σ_t log π_θ(y_t|..), NLL = −S (summed over tokens: the
authors found the sum better than the mean), A = R − V(x) precomputed (hpc_tba.losses.value),
A+ = max(A, 0), ρ = exp(S − S_ref) and ρ_t = exp(log π_θ(y_t) − log π_ref(y_t)):

| variant    | per-example loss                                         |
|------------|----------------------------------------------------------|
| a_lol      | sg[clip(ρ, 1−ε, 1+ε)] · A+ · NLL                         |
| ref_free   | A+ · NLL                                                 |
| seq        | A+ · Σ_t sg[clip(ρ_t, 1−ε, 1+ε)] · NLL_t                 |
| kl         | 1[A > 0] · (A+ · NLL + β_KL · (S − S_ref))               |
| r_lol      | sg[clip(ρ, 1−ε, 1+ε)] · R · NLL   (R not clipped at 0)   |

The clipped ratio is a detached multiplier, not PPO's min-clip. "Negative-advantage examples are
never trained on" (the paper drops them from the data): every variant but r_lol gives them zero
loss, which is why ref_free uses A+ where the paper's table writes A, and kl's KL term is also
restricted to A > 0. Ratios are clipped in log space, so S − S_ref of ±500 cannot overflow.
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
    valid_rows,
)

VARIANTS = ("a_lol", "ref_free", "seq", "kl", "r_lol")


def alol(
    logp: Tensor,
    ref_logp: Tensor | None,
    mask: Tensor,
    advantages: Tensor,
    *,
    variant: str = "a_lol",
    clip_eps: float = 0.9,
    kl_beta: float = 0.0,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """A-LoL loss in one of its variants (table in the module docstring).

    Args:
        logp: [B, T] per-token log π_θ (requires grad).
        ref_logp: [B, T] per-token log π_ref; may be None only for variant="ref_free".
        mask: [B, T] bool response tokens.
        advantages: [B] A = R − V(x); for "r_lol" the rewards R themselves.
        variant: a_lol, ref_free, seq, kl or r_lol.
        clip_eps: ε of the importance-weight clip [1 − ε, 1 + ε].
        kl_beta: β_KL of the kl variant.
        normalizer: divide the summed loss by this; default the number of non-empty rows.

    Returns:
        (loss, metrics) with `loss/alol`, `alol/adv_pos_frac`, `alol/weight_mean`,
        `alol/weight_clip_frac` (weights at a clip bound), `alol/kl_ref` (mean S − S_ref).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {', '.join(VARIANTS)}")
    if not 0.0 <= clip_eps < 1.0:
        raise ValueError(f"clip_eps must be in [0, 1), got {clip_eps}")
    if ref_logp is None and variant != "ref_free":
        raise ValueError(f"A-LoL variant {variant!r} needs ref_logp")
    check_shapes(logp, mask, tokens=(ref_logp,), samples=(advantages,))
    valid = valid_rows(mask)                                          # [B]
    adv = advantages.detach().float()                                 # [B]
    trained = (adv > 0) if variant != "r_lol" else torch.ones_like(valid)
    coef = adv if variant == "r_lol" else adv.clamp(min=0.0)          # [B] A+ (or R)
    lo, hi = 1.0 - clip_eps, 1.0 + clip_eps
    s = masked_sum(logp, mask)                                        # [B] S = −NLL
    s_ref = masked_sum(ref_logp.detach(), mask) if ref_logp is not None else None
    weight = torch.ones_like(s)                                       # [B], per-sample mean weight
    if variant in ("a_lol", "r_lol"):
        weight = clipped_ratio(s - s_ref, lo, hi)
        per_sample = -weight * coef * s
    elif variant == "ref_free":
        per_sample = -coef * s
    elif variant == "seq":
        # Zero the padding first: a NaN weight there would reach the gradient through the product.
        lp = torch.where(mask, logp.float(), 0.0)                     # [B, T]
        w_tok = clipped_ratio(lp - torch.where(mask, ref_logp.float(), 0.0), lo, hi)   # [B, T] detached
        per_sample = -coef * masked_sum(w_tok * lp, mask)
        weight = masked_sum(w_tok, mask) / mask.sum(dim=-1).clamp(min=1)
    else:  # kl
        per_sample = -coef * s + kl_beta * (s - s_ref)
    loss = reduce_loss(torch.where(trained, per_sample, 0.0), valid, normalizer)

    with torch.no_grad():
        at_bound = (weight <= lo * (1 + 1e-6)) | (weight >= hi * (1 - 1e-6))
        metrics = {
            "loss/alol": loss.detach(),
            "alol/adv_pos_frac": masked_mean_rows((adv > 0).float(), valid),
            "alol/adv_mean": masked_mean_rows(adv, valid),
            "alol/weight_mean": masked_mean_rows(weight, valid & trained),
            "alol/weight_clip_frac": masked_mean_rows(at_bound.float(), valid & trained)
            if variant in ("a_lol", "r_lol") else s.new_zeros(()),
        }
        if s_ref is not None:
            metrics["alol/kl_ref"] = masked_mean_rows(s - s_ref, valid)
    return loss, metrics

