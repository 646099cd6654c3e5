"""Typed configuration of the training objective (`algo=` group)."""
from __future__ import annotations

import dataclasses

ALGOS = ("tb", "topr", "alol", "grpo", "rloo", "dpo", "sft")


@dataclasses.dataclass
class LossConfig:
    """The objective and its hyper-parameters; defaults are TBA's GSM8K run (ALGORITHMS.md §1)."""

    name: str = "tb"
    """Objective: one of tb, topr, alol, grpo, rloo, dpo, sft."""
    beta0: float = 0.012
    """TB: KL coefficient / reward temperature at step 0."""
    beta_final: float = 0.004
    """TB: β reached at the end of the linear schedule."""
    beta_steps: int = 500
    """TB: learner updates over which β goes linearly from beta0 to beta_final."""

    def __post_init__(self) -> None:
        if self.name not in ALGOS:
            raise ValueError(f"algo.name={self.name!r} is not one of {', '.join(ALGOS)}")
        if self.beta0 <= 0 or self.beta_final <= 0:
            raise ValueError("algo.beta0 and algo.beta_final must be > 0 (β divides the reward)")
        if self.beta_steps < 0:
            raise ValueError("algo.beta_steps must be >= 0")

    @property
    def needs_reference(self) -> bool:
        """Whether the learner must compute log-probs under the frozen reference policy."""
        return self.name in ("tb", "alol", "grpo", "dpo")

    def beta(self, step: int) -> float:
        """β at learner step `step`: linear from beta0 to beta_final over beta_steps, then constant."""
        if self.beta_steps == 0 or step >= self.beta_steps:
            return self.beta_final
        return self.beta0 + (self.beta_final - self.beta0) * step / self.beta_steps
