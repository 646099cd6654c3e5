"""GRPO (`algo=grpo`): config and registration (math: losses/baselines.py)."""
from __future__ import annotations

import dataclasses

from hpc_tba.config import AlgoConfig, ranged
from hpc_tba.losses.registry import Needs, Objective, need, register


@dataclasses.dataclass
class GrpoConfig(AlgoConfig):
    """GRPO's hyper-parameters (ALGORITHMS.md §4)."""

    name: str = "grpo"
    grpo_clip_eps: float = ranged(0.2, gt=0, lt=1)
    """GRPO: PPO clip range of the per-token ratio to the behaviour policy."""
    grpo_scale_std: bool = True
    """GRPO: divide group-centred rewards by the group std (False = Dr. GRPO's centring only)."""
    kl_coef: float = ranged(0.0, ge=0, note="0: no KL penalty")
    """GRPO: weight of the k3 KL penalty to the reference (0 = no reference model needed)."""

    def __post_init__(self) -> None:
        super().__post_init__()


def _compute(cfg: GrpoConfig, x, *, step: int, normalizer):
    from hpc_tba.losses.baselines import grpo

    ref = need(x, "logp_ref", cfg) if cfg.kl_coef > 0 else None
    return grpo(x.logp, x.logp_behavior, x.mask, x.rewards, x.group_ids, ref_logp=ref,
                clip_eps=cfg.grpo_clip_eps, kl_coef=cfg.kl_coef, scale_std=cfg.grpo_scale_std,
                normalizer=normalizer)


# The group mean/std use rewards only: not group-coupled. The clipped ratio is to log μ.
register(Objective("grpo", GrpoConfig, _compute,
                   lambda cfg: Needs(reference=cfg.kl_coef > 0, behavior_logp=True)))
