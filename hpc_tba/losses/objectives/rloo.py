"""RLOO (`algo=rloo`): config and registration (math: losses/baselines.py)."""
from __future__ import annotations

import dataclasses

from hpc_tba.config import AlgoConfig, ranged
from hpc_tba.losses.registry import Needs, Objective, need, register


@dataclasses.dataclass
class RlooConfig(AlgoConfig):
    """RLOO's hyper-parameters (ALGORITHMS.md §4)."""

    name: str = "rloo"
    kl_coef: float = ranged(0.0, ge=0, note="0: no KL shaping")
    """RLOO: weight of the KL shaping of the reward, −kl_coef·(S − S_ref) (0 = no reference model)."""
    length_normalize: bool = False
    """RLOO: divide each sample's summed log-prob by its length (False: sum, as RLOO's paper)."""


def _compute(cfg: RlooConfig, x, *, step: int, normalizer):
    from hpc_tba.losses.baselines import rloo

    ref = need(x, "logp_ref", cfg) if cfg.kl_coef > 0 else None
    return rloo(x.logp, x.mask, x.rewards, x.group_ids, ref_logp=ref, kl_coef=cfg.kl_coef,
                length_normalize=cfg.length_normalize, normalizer=normalizer)


# With KL shaping the leave-one-out baseline holds the other samples' CURRENT S: group-coupled.
register(Objective("rloo", RlooConfig, _compute,
                   lambda cfg: Needs(reference=cfg.kl_coef > 0, group_coupled=cfg.kl_coef > 0)))
