"""A test objective from outside the package: ONE module (this) plus ONE yaml (configs/algo/).

Clipped importance-weighted policy gradient: per sample −w·(R − mean R of its group)·S with
w = min(π_θ/μ, cpg_ratio_max) on the sequence (detached), plus cpg_kl_coef·(S − S_ref) when the
coefficient is > 0. It declares what it needs: behaviour log-probs always, the reference only
with the KL term; its group mean uses rewards only (not group-coupled).
Used by tests/test_loss_plugin.py with HPC_TBA_CONFIG_PATH=tests/plugins/configs.
"""
from __future__ import annotations

import dataclasses
import math

from hpc_tba.config import AlgoConfig, ranged
from hpc_tba.losses.registry import Needs, Objective, need, register


@dataclasses.dataclass
class ClippedPGConfig(AlgoConfig):
    """Clipped importance-weighted policy gradient."""

    name: str = "clipped_pg"
    module: str = "plugins.clipped_pg_loss"
    cpg_ratio_max: float = ranged(2.0, ge=1)
    """Upper clip of the sequence importance weight π_θ/μ (>= 1)."""
    cpg_kl_coef: float = ranged(0.0, ge=0, note="0: no reference model")
    """Weight of the KL estimate S − S_ref (0: no reference model needed)."""
    # Both ranges are checked by AlgoConfig.__post_init__ (hpc_tba.config.ranges); a check across
    # fields would go in a __post_init__ of its own, after super().__post_init__().


def compute(cfg: ClippedPGConfig, x, *, step: int, normalizer):
    from hpc_tba.losses.common import group_mean, masked_mean_rows, masked_sum, reduce_loss, same_group, valid_rows

    valid = valid_rows(x.mask)
    s = masked_sum(x.logp, x.mask)
    w = (s - masked_sum(x.logp_behavior, x.mask)).detach().clamp(max=math.log(cfg.cpg_ratio_max)).exp()
    baseline, _ = group_mean(x.rewards.float(), same_group(x.group_ids, valid))
    per = -w * (x.rewards.float() - baseline) * s
    if cfg.cpg_kl_coef > 0:
        per = per + cfg.cpg_kl_coef * (s - masked_sum(need(x, "logp_ref", cfg).detach(), x.mask))
    loss = reduce_loss(per, valid, normalizer)
    return loss, {"loss/clipped_pg": loss.detach(), "clipped_pg/weight_mean": masked_mean_rows(w, valid)}


register(Objective("clipped_pg", ClippedPGConfig, compute,
                   lambda cfg: Needs(reference=cfg.cpg_kl_coef > 0, behavior_logp=True)))
