"""The part of the training objective's configuration (`algo=` group) that every objective has.

Each objective declares its own config, a subclass of AlgoConfig with its (name-prefixed) fields,
in its loss module (hpc_tba/losses/objectives/, or a plugin module named by `algo.module`), and
registers it in hpc_tba.losses.registry; `configs/algo/<name>.yaml` sets its paper's defaults
(ALGORITHMS.md). Composition (hpc_tba.assembly.compose) picks the class from `algo.name`.
"""
from __future__ import annotations

import dataclasses

from hpc_tba.config.ranges import check_ranges

REWARD_MAPS = ("auto", "pm1", "none")


@dataclasses.dataclass
class AlgoConfig:
    """Fields every objective has; a run's `algo` is an instance of the objective's subclass."""

    name: str = "tb"
    """Objective: a built-in (tb, topr, alol, grpo, rloo, dpo, sft) or a plugin's registered name."""
    module: str = ""
    """Python module that defines and registers a non-built-in objective (imported at
    composition); empty for the built-ins."""
    reward_map: str = "auto"
    """TOPR: how task rewards become TOPR's rewards. pm1: R in the declared [low, high] maps
    linearly to [−1, +1] (the paper's ±1; 0/1 rewards become −1/+1), and topr_baseline /
    topr_positive_threshold are in those units. none: raw rewards, baseline and threshold in the
    task's units. auto: none when the task's range is already [−1, 1], pm1 when the baseline and
    threshold are left at 0, refused otherwise (the units they are in would be a guess). Every
    other objective uses the task's rewards as they are (resolved to none)."""
    reward_range: list[float] = dataclasses.field(default_factory=list)
    """[low, high] of the task's rewards, filled in at composition from the task's declaration
    (hpc_tba.tasks.reward_range); empty = undeclared."""

    def __post_init__(self) -> None:
        check_ranges(self, "algo")  # the subclass's ranged fields too
        if not self.name:
            raise ValueError("algo.name is empty: name the objective (e.g. algo=tb)")
        if self.reward_map not in REWARD_MAPS:
            raise ValueError(f"algo.reward_map={self.reward_map!r} is not one of {', '.join(REWARD_MAPS)}")
        if self.reward_range and (len(self.reward_range) != 2 or
                                  not float(self.reward_range[0]) < float(self.reward_range[1])):
            raise ValueError(f"algo.reward_range={list(self.reward_range)} must be [low, high], low < high")

    def fit_rewards(self, task_range: tuple[float, float] | None, *, task: str) -> AlgoConfig:
        """This config with reward_map resolved against the task's declared reward range and
        algo.reward_range filled in. Objectives that use the task's rewards as they are (all but
        TOPR, which overrides this) refuse reward_map=pm1 and resolve it to none."""
        rng = (float(self.reward_range[0]), float(self.reward_range[1])) if self.reward_range else task_range
        if self.reward_map == "pm1":
            raise ValueError(f"algo.reward_map=pm1 sets TOPR's ±1 rewards; algo={self.name} uses "
                             "the task's rewards as they are: use algo.reward_map=auto or none")
        return dataclasses.replace(self, reward_map="none", reward_range=list(rng) if rng is not None else [])
