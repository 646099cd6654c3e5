"""The dispatcher the learner calls: `compute_loss(cfg, LossInputs(...))` and `loss_units`; what
each objective computes and needs is its registration (hpc_tba.losses.registry)."""
from __future__ import annotations

import dataclasses

from torch import Tensor

from hpc_tba.config import AlgoConfig
from hpc_tba.losses.common import (
    masked_mean_rows,
    ratio_metrics,
    valid_rows,
)
from hpc_tba.losses.registry import needs, objective_of


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """One micro-batch as the learner hands it to `compute_loss`; whole prompt groups only."""

    logp: Tensor
    """[B, T] per-token log-probs under the current policy π_θ (requires grad)."""
    logp_ref: Tensor | None
    """[B, T] per-token log-probs under the frozen reference, or None when the objective needs none
    (registry.needs(cfg).reference)."""
    logp_behavior: Tensor
    """[B, T] per-token log-probs under the policy that generated the sample (searcher engine)."""
    mask: Tensor
    """[B, T] bool, True on response tokens (identical for every policy's log-probs)."""
    rewards: Tensor
    """[B] float sequence rewards."""
    group_ids: Tensor
    """[B] long prompt ids; samples of one prompt form a group (TB logZ, GRPO/RLOO baselines, DPO pairs)."""
    advantages: Tensor | None = None
    """[B] precomputed A-LoL advantages A = R − V(x) (hpc_tba.losses.value), or None."""
    logz: Tensor | None = None
    """[B] learned logZ of each sample's prompt, with grad; only for tb with tb_logz=learned."""


def compute_loss(cfg: AlgoConfig, inputs: LossInputs, *, step: int,
                 normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The configured objective (hpc_tba.losses.registry) on one micro-batch: `(loss, metrics)`.

    `step` is the learner step (TB's β schedule); `normalizer` the global number of loss units
    (see `loss_units`), default the local one. Adds to every loss's own metrics the ratio
    statistics of the current policy against the behaviour policy (`loss/ratio_*`), the mean
    reward and response length.
    """
    x = inputs
    loss, metrics = objective_of(cfg).compute(cfg, x, step=step, normalizer=normalizer)
    valid = valid_rows(x.mask)
    metrics.update(ratio_metrics(x.logp, x.logp_behavior, x.mask))
    metrics["loss/reward_mean"] = masked_mean_rows(x.rewards, valid)
    metrics["loss/response_len"] = masked_mean_rows(x.mask.sum(dim=-1), valid)
    metrics["loss/total"] = loss.detach()
    return loss, metrics


def group_coupled(cfg: AlgoConfig) -> bool:
    """Whether one sample's loss gradient depends on the CURRENT log-probs of other samples of
    its group (not only on their rewards), as the objective declares (Needs.group_coupled): e.g.
    TB's VarGrad logZ, RLOO's KL-shaped leave-one-out baseline, DPO's pairs. Micro-batching that
    splits groups then needs a no-grad pass for those values (hpc_tba.roles.microbatch); GRPO's
    group mean/std use rewards only."""
    return needs(cfg).group_coupled


def loss_units(cfg: AlgoConfig, inputs: LossInputs) -> Tensor:
    """Local number of loss units (a 0-dim tensor): non-empty rows, or what the objective
    declares (preference pairs for DPO).

    All-reduce (SUM) this over data-parallel ranks and pass it as `normalizer` to `compute_loss`.
    """
    units = objective_of(cfg).units
    if units is not None:
        return units(cfg, inputs)
    return valid_rows(inputs.mask).sum().float()
