"""SFT / rejection sampling (`algo=sft`): config and registration (math: losses/baselines.py)."""
from __future__ import annotations

import dataclasses
import math

from hpc_tba.config import AlgoConfig, ranged
from hpc_tba.losses.registry import Objective, register


@dataclasses.dataclass
class SftConfig(AlgoConfig):
    """SFT's hyper-parameters (ALGORITHMS.md §4)."""

    name: str = "sft"
    sft_min_reward: float = ranged(0.0, ge=-math.inf, le=math.inf, note="-inf keeps every sample")
    """SFT (rejection sampling): train on samples with reward > this (-inf keeps every sample)."""
    length_normalize: bool = False
    """SFT: divide each sample's summed log-prob by its length."""


def _compute(cfg: SftConfig, x, *, step: int, normalizer):
    from hpc_tba.losses.baselines import sft

    return sft(x.logp, x.mask, x.rewards, min_reward=cfg.sft_min_reward,
               length_normalize=cfg.length_normalize, normalizer=normalizer)


register(Objective("sft", SftConfig, _compute))
