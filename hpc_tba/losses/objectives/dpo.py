"""DPO on pairs inside each prompt's group (`algo=dpo`): config and registration (math:
losses/baselines.py). Its loss units are pairs, not samples."""
from __future__ import annotations

import dataclasses

from hpc_tba.config import AlgoConfig, ranged
from hpc_tba.losses.registry import Needs, Objective, need, register

DPO_PAIRINGS = ("best_worst", "all")


@dataclasses.dataclass
class DpoConfig(AlgoConfig):
    """DPO's hyper-parameters (ALGORITHMS.md §4)."""

    name: str = "dpo"
    dpo_beta: float = ranged(0.1, gt=0)
    """DPO: inverse temperature of the implicit reward β·(log π_θ − log π_ref)."""
    dpo_pairing: str = "best_worst"
    """DPO: pairs per prompt group: 'best_worst' (one pair) or 'all' (every higher/lower pair)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dpo_pairing not in DPO_PAIRINGS:
            raise ValueError(f"algo.dpo_pairing={self.dpo_pairing!r} is not one of {', '.join(DPO_PAIRINGS)}")


def _compute(cfg: DpoConfig, x, *, step: int, normalizer):
    from hpc_tba.losses.baselines import dpo

    return dpo(x.logp, need(x, "logp_ref", cfg), x.mask, x.rewards, x.group_ids, beta=cfg.dpo_beta,
               pairing=cfg.dpo_pairing, normalizer=normalizer)


def _units(cfg: DpoConfig, x):
    from hpc_tba.losses.baselines import dpo_pairs
    from hpc_tba.losses.common import valid_rows

    return dpo_pairs(x.rewards, x.group_ids, valid_rows(x.mask), pairing=cfg.dpo_pairing).sum().float()


# A pair's gradient holds its partner's CURRENT log-probs: group-coupled.
register(Objective("dpo", DpoConfig, _compute, lambda cfg: Needs(reference=True, group_coupled=True),
                   units=_units))
