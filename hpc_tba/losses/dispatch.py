"""The dispatcher the learner calls: `compute_loss(cfg, LossInputs(...))` and `loss_units`."""
from __future__ import annotations

import dataclasses

from torch import Tensor

from hpc_tba.losses.alol_loss import alol
from hpc_tba.losses.baselines import dpo, dpo_pairs, grpo, rloo, sft
from hpc_tba.losses.common import (
    masked_mean_rows,
    ratio_metrics,
    valid_rows,
)
from hpc_tba.losses.config import LossConfig
from hpc_tba.losses.tb import trajectory_balance
from hpc_tba.losses.topr_loss import topr


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """One micro-batch as the learner hands it to `compute_loss`; whole prompt groups only."""

    logp: Tensor
    """[B, T] per-token log-probs under the current policy π_θ (requires grad)."""
    logp_ref: Tensor | None
    """[B, T] per-token log-probs under the frozen reference, or None when cfg.needs_reference is False."""
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


def _need(inputs: LossInputs, field: str, cfg: LossConfig) -> Tensor:
    value = getattr(inputs, field)
    if value is None:
        raise ValueError(f"algo={cfg.name} (variant settings as configured) needs LossInputs.{field}; got None")
    return value


def compute_loss(cfg: LossConfig, inputs: LossInputs, *, step: int,
                 normalizer: float | Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The configured objective on one micro-batch: `(loss, metrics)`.

    `step` is the learner step (TB's β schedule); `normalizer` the global number of loss units
    (see `loss_units`), default the local one. Adds to every loss's own metrics the ratio
    statistics of the current policy against the behaviour policy (`loss/ratio_*`), the mean
    reward and response length.
    """
    x = inputs
    name = cfg.name
    if name == "tb":
        logz = _need(x, "logz", cfg) if cfg.tb_logz == "learned" else None
        loss, metrics = trajectory_balance(x.logp, _need(x, "logp_ref", cfg), x.mask, x.rewards,
                                           x.group_ids, cfg.beta(step), logz=logz, normalizer=normalizer)
    elif name == "topr":
        loss, metrics = topr(x.logp, x.logp_behavior, x.mask, x.rewards, baseline=cfg.topr_baseline,
                             pos_clip=(cfg.topr_pos_min, cfg.topr_pos_max),
                             neg_clip=(cfg.topr_neg_min, cfg.topr_neg_max),
                             length_normalize=cfg.topr_length_normalize,
                             positive_threshold=cfg.topr_positive_threshold, normalizer=normalizer)
    elif name == "alol":
        adv = x.rewards if cfg.alol_variant == "r_lol" else _need(x, "advantages", cfg)
        ref = x.logp_ref if cfg.alol_variant == "ref_free" else _need(x, "logp_ref", cfg)
        loss, metrics = alol(x.logp, ref, x.mask, adv, variant=cfg.alol_variant,
                             clip_eps=cfg.alol_clip_eps, kl_beta=cfg.alol_kl_beta, normalizer=normalizer)
    elif name == "grpo":
        ref = _need(x, "logp_ref", cfg) if cfg.kl_coef > 0 else None
        loss, metrics = grpo(x.logp, x.logp_behavior, x.mask, x.rewards, x.group_ids, ref_logp=ref,
                             clip_eps=cfg.grpo_clip_eps, kl_coef=cfg.kl_coef,
                             scale_std=cfg.grpo_scale_std, normalizer=normalizer)
    elif name == "rloo":
        ref = _need(x, "logp_ref", cfg) if cfg.kl_coef > 0 else None
        loss, metrics = rloo(x.logp, x.mask, x.rewards, x.group_ids, ref_logp=ref, kl_coef=cfg.kl_coef,
                             length_normalize=cfg.length_normalize, normalizer=normalizer)
    elif name == "dpo":
        loss, metrics = dpo(x.logp, _need(x, "logp_ref", cfg), x.mask, x.rewards, x.group_ids,
                            beta=cfg.dpo_beta, pairing=cfg.dpo_pairing, normalizer=normalizer)
    elif name == "sft":
        loss, metrics = sft(x.logp, x.mask, x.rewards, min_reward=cfg.sft_min_reward,
                            length_normalize=cfg.length_normalize, normalizer=normalizer)
    else:  # LossConfig.__post_init__ already refuses unknown names
        raise ValueError(f"unknown loss {name!r}")
    valid = valid_rows(x.mask)
    metrics.update(ratio_metrics(x.logp, x.logp_behavior, x.mask))
    metrics["loss/reward_mean"] = masked_mean_rows(x.rewards, valid)
    metrics["loss/response_len"] = masked_mean_rows(x.mask.sum(dim=-1), valid)
    metrics["loss/total"] = loss.detach()
    return loss, metrics


def group_coupled(cfg: LossConfig) -> bool:
    """Whether one sample's loss gradient depends on the CURRENT log-probs of other samples of
    its group (not only on their rewards): TB's VarGrad logZ, RLOO's KL-shaped leave-one-out
    baseline, DPO's pairs. Micro-batching that splits groups then needs a no-grad pass for those
    values (hpc_tba.roles.microbatch); GRPO's group mean/std use rewards only."""
    if cfg.name == "tb":
        return cfg.tb_logz == "vargrad"
    if cfg.name == "rloo":
        return cfg.kl_coef > 0
    return cfg.name == "dpo"


def loss_units(cfg: LossConfig, inputs: LossInputs) -> Tensor:
    """Local number of loss units (a 0-dim tensor): non-empty rows, or preference pairs for DPO.

    All-reduce (SUM) this over data-parallel ranks and pass it as `normalizer` to `compute_loss`.
    """
    if cfg.name == "dpo":
        pairs = dpo_pairs(inputs.rewards, inputs.group_ids, valid_rows(inputs.mask), pairing=cfg.dpo_pairing)
        return pairs.sum().float()
    return valid_rows(inputs.mask).sum().float()

