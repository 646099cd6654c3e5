"""SFT / rejection sampling (`algo=sft`): config and registration (math: losses/baselines.py)."""
from __future__ import annotations

import dataclasses
import math

from hpc_tba.config import AlgoConfig
from hpc_tba.losses.registry import Objective, register


@dataclasses.dataclass
class SftConfig(AlgoConfig):
    """SFT's hyper-parameters (ALGORITHMS.md §4)."""

    name: str = "sft"
    sft_min_reward: float = 0.0
    """SFT (rejection sampling): train on samples with reward > this (-inf keeps every sample)."""
    length_normalize: bool = False
    """SFT: divide each sample's summed log-prob by its length."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if math.isnan(self.sft_min_reward):
            raise ValueError("algo.sft_min_reward must be a number (use -inf to keep every sample)")


def _compute(cfg: SftConfig, x, *, step: int, normalizer):
    from hpc_tba.losses.baselines import sft

    return sft(x.logp, x.mask, x.rewards, min_reward=cfg.sft_min_reward,
               length_normalize=cfg.length_normalize, normalizer=normalizer)


register(Objective("sft", SftConfig, _compute))
