"""Advantage-Leftover-Lunch RL (`algo=alol`): config and registration (math: losses/alol_loss.py)."""
from __future__ import annotations

import dataclasses

from hpc_tba.config import AlgoConfig, ranged
from hpc_tba.losses.registry import Needs, Objective, need, register

ALOL_VARIANTS = ("a_lol", "ref_free", "seq", "kl", "r_lol")


@dataclasses.dataclass
class AlolConfig(AlgoConfig):
    """A-LoL's hyper-parameters (ALGORITHMS.md §3)."""

    name: str = "alol"
    alol_variant: str = "a_lol"
    """A-LoL: one of a_lol, ref_free, seq, kl, r_lol (ALGORITHMS.md §3)."""
    alol_clip_eps: float = ranged(0.9, ge=0, lt=1, note="so weights stay positive")
    """A-LoL: importance weights clipped to [1 − ε, 1 + ε] (0.9 gives [0.1, 1.9])."""
    alol_kl_beta: float = ranged(0.0, ge=0)
    """A-LoL KL variant: coefficient of (log π_θ − log π_ref); must be > 0 for variant=kl."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alol_variant not in ALOL_VARIANTS:
            raise ValueError(f"algo.alol_variant={self.alol_variant!r} is not one of {', '.join(ALOL_VARIANTS)}")
        if self.alol_variant == "kl" and self.alol_kl_beta <= 0:
            raise ValueError("algo.alol_variant=kl needs algo.alol_kl_beta > 0 (else it is ref_free on A+)")


def _compute(cfg: AlolConfig, x, *, step: int, normalizer):
    from hpc_tba.losses.alol_loss import alol

    adv = x.rewards if cfg.alol_variant == "r_lol" else need(x, "advantages", cfg)
    ref = x.logp_ref if cfg.alol_variant == "ref_free" else need(x, "logp_ref", cfg)
    return alol(x.logp, ref, x.mask, adv, variant=cfg.alol_variant, clip_eps=cfg.alol_clip_eps,
                kl_beta=cfg.alol_kl_beta, normalizer=normalizer)


def _needs(cfg: AlolConfig) -> Needs:
    return Needs(reference=cfg.alol_variant != "ref_free", advantages=cfg.alol_variant != "r_lol")


register(Objective("alol", AlolConfig, _compute, _needs))
