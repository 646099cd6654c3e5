"""Tapered off-policy REINFORCE (`algo=topr`): config, reward map and registration (math:
losses/topr_loss.py)."""
from __future__ import annotations

import dataclasses
import math

from hpc_tba.config import AlgoConfig, ranged
from hpc_tba.losses.registry import Needs, Objective, register


@dataclasses.dataclass
class ToprConfig(AlgoConfig):
    """TOPR's hyper-parameters (ALGORITHMS.md §2); reward_map / reward_range: AlgoConfig."""

    name: str = "topr"
    topr_baseline: float = ranged(0.0)
    """TOPR: baseline c subtracted from rewards (R − c); sets the effective positive fraction."""
    topr_pos_min: float = ranged(1.0, ge=0)
    """TOPR: lower clip of the importance ratio for samples with reward >= 0 (TOPR: 1)."""
    topr_pos_max: float = ranged(1.0, ge=0, le=math.inf, note="inf: no upper clip")
    """TOPR: upper clip of the ratio for reward >= 0 (TOPR: 1 = plain SFT on positives)."""
    topr_neg_min: float = ranged(0.0, ge=0)
    """TOPR: lower clip of the ratio for reward < 0 (TOPR: 0)."""
    topr_neg_max: float = ranged(1.0, ge=0, le=math.inf, note="inf: no upper clip")
    """TOPR: upper clip of the ratio for reward < 0 (TOPR: 1 = truncated IS, tapers to 0)."""
    topr_length_normalize: bool = True
    """TOPR: divide each sample's loss by its response length |y|."""
    topr_positive_threshold: float = ranged(0.0)
    """TOPR: rewards >= this are positives (0 for ±1 rewards; 0.5 with baseline 0.5 for 0/1 rewards)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for kind in ("pos", "neg"):
            lo, hi = getattr(self, f"topr_{kind}_min"), getattr(self, f"topr_{kind}_max")
            if not lo <= hi:
                raise ValueError(f"algo.topr_{kind}_min/max must satisfy 0 <= min <= max (got {lo}, {hi}); "
                                 "they clip an importance ratio")

    def topr_rewards(self, rewards):
        """TOPR's rewards from the task's (a tensor or array): mapped to [−1, 1] under
        reward_map=pm1 (low -> −1, high -> +1), unchanged under none."""
        if self.reward_map != "pm1":
            return rewards
        low, high = (float(v) for v in self.reward_range)
        return (rewards - low) * (2.0 / (high - low)) - 1.0

    def fit_rewards(self, task_range: tuple[float, float] | None, *, task: str) -> ToprConfig:
        """reward_map resolved against the task's declared range (AlgoConfig.fit_rewards); raises
        ValueError when TOPR's positive/negative split would be ill-defined."""
        rng = (float(self.reward_range[0]), float(self.reward_range[1])) if self.reward_range else task_range
        stored = list(rng) if rng is not None else []
        mode = self.reward_map
        if mode == "auto":
            mode = self._auto_reward_map(rng, task)
        if mode == "pm1" and rng is None:
            raise ValueError(f"algo.reward_map=pm1 maps the task's reward range to ±1, but task={task} "
                             "declares none: set task.reward_range=[low, high]")
        units = (-1.0, 1.0) if mode == "pm1" else rng
        if units is not None:
            lo, hi = units
            where = "TOPR's ±1 units" if mode == "pm1" else f"task {task}'s reward units [{lo:g}, {hi:g}]"
            t, c = self.topr_positive_threshold, self.topr_baseline
            if not lo < t <= hi:
                raise ValueError(f"algo.topr_positive_threshold={t:g} in {where} makes every sample "
                                 f"{'positive' if t <= lo else 'negative'}: it must be in ({lo:g}, {hi:g}]")
            if not lo < c < hi:
                raise ValueError(f"algo.topr_baseline={c:g} in {where}: R − c must be negative for the "
                                 f"lowest reward and positive for the highest, so c must be in ({lo:g}, {hi:g})")
        return dataclasses.replace(self, reward_map=mode, reward_range=stored)

    def _auto_reward_map(self, rng: tuple[float, float] | None, task: str) -> str:
        if rng is None:
            raise ValueError(f"algo=topr with task={task}: the task declares no reward range, so which "
                             "rewards are negatives is unknown: set task.reward_range=[low, high] (auto then "
                             "maps it to ±1), or algo.reward_map=none with algo.topr_positive_threshold "
                             "and algo.topr_baseline in the task's units")
        if rng == (-1.0, 1.0):
            return "none"
        if self.topr_baseline == 0.0 and self.topr_positive_threshold == 0.0:
            return "pm1"
        raise ValueError(f"algo=topr with task={task} (rewards in [{rng[0]:g}, {rng[1]:g}]) and "
                         f"algo.topr_baseline={self.topr_baseline:g}, algo.topr_positive_threshold="
                         f"{self.topr_positive_threshold:g} under algo.reward_map=auto is ambiguous: say "
                         "whether these are in TOPR's ±1 units (algo.reward_map=pm1) or the task's "
                         "(algo.reward_map=none)")


def _compute(cfg: ToprConfig, x, *, step: int, normalizer):
    from hpc_tba.losses.topr_loss import topr

    return topr(x.logp, x.logp_behavior, x.mask, cfg.topr_rewards(x.rewards), baseline=cfg.topr_baseline,
                pos_clip=(cfg.topr_pos_min, cfg.topr_pos_max), neg_clip=(cfg.topr_neg_min, cfg.topr_neg_max),
                length_normalize=cfg.topr_length_normalize,
                positive_threshold=cfg.topr_positive_threshold, normalizer=normalizer)


register(Objective("topr", ToprConfig, _compute, lambda cfg: Needs(behavior_logp=True)))
