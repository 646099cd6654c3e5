"""Trajectory balance (TBA's objective, `algo=tb`): config and registration (math: losses/tb.py)."""
from __future__ import annotations

import dataclasses

from hpc_tba.config import AlgoConfig, ranged
from hpc_tba.losses.registry import Needs, Objective, need, register

TB_LOGZ = ("vargrad", "learned")


@dataclasses.dataclass
class TBConfig(AlgoConfig):
    """TB's hyper-parameters; defaults are TBA's GSM8K run (ALGORITHMS.md §1)."""

    name: str = "tb"
    beta0: float = ranged(0.012, gt=0, note="β divides the reward")
    """TB: KL coefficient / reward temperature at step 0."""
    beta_final: float = ranged(0.004, gt=0, note="β divides the reward")
    """TB: β reached at the end of the linear schedule."""
    beta_steps: int = ranged(500, ge=0, note="0: beta_final from the start")
    """TB: learner updates over which β goes linearly from beta0 to beta_final."""
    tb_logz: str = "vargrad"
    """TB: 'vargrad' (per-prompt batch estimate, the paper's). 'learned' (a logZ per prompt owned
    by the learner) exists in the loss but a run refuses it (composition): no learner owns one."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tb_logz not in TB_LOGZ:
            raise ValueError(f"algo.tb_logz={self.tb_logz!r} is not one of {', '.join(TB_LOGZ)}")

    def beta(self, step: int) -> float:
        """β at learner step `step`: linear from beta0 to beta_final over beta_steps, then constant."""
        if self.beta_steps == 0 or step >= self.beta_steps:
            return self.beta_final
        return self.beta0 + (self.beta_final - self.beta0) * step / self.beta_steps


def _compute(cfg: TBConfig, x, *, step: int, normalizer):
    from hpc_tba.losses.tb import trajectory_balance

    logz = need(x, "logz", cfg) if cfg.tb_logz == "learned" else None
    return trajectory_balance(x.logp, need(x, "logp_ref", cfg), x.mask, x.rewards, x.group_ids,
                              cfg.beta(step), logz=logz, normalizer=normalizer)


def _check_run(cfg: TBConfig) -> None:
    if cfg.tb_logz == "learned":
        # The loss accepts a logZ tensor, but no learner owns one: a per-prompt logZ table would be
        # a trained, checkpointed parameter sharded by the buffer's prompt routing, outside the
        # ZeRO-3 model (roles/learner.py). Refused at composition rather than at the first step.
        raise ValueError("algo.tb_logz=learned is not supported by the learner (it holds no logZ "
                         "parameter to train); use algo.tb_logz=vargrad, the TBA paper's per-prompt "
                         "batch estimate")


# VarGrad's logZ is a mean over the group's CURRENT log-probs: group-coupled.
register(Objective("tb", TBConfig, _compute,
                   lambda cfg: Needs(reference=True, group_coupled=cfg.tb_logz == "vargrad"),
                   check_run=_check_run))
