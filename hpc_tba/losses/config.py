"""Typed configuration of the training objective (`algo=` group).

One flat dataclass for all objectives, mirrored by `configs/algo/<name>.yaml`; fields used by one
objective only carry its name as a prefix. Defaults are TBA's GSM8K run; each yaml sets its paper's
defaults (ALGORITHMS.md).
"""
from __future__ import annotations

import dataclasses
import math

ALGOS = ("tb", "topr", "alol", "grpo", "rloo", "dpo", "sft")
TB_LOGZ = ("vargrad", "learned")
REWARD_MAPS = ("auto", "pm1", "none")
ALOL_VARIANTS = ("a_lol", "ref_free", "seq", "kl", "r_lol")
DPO_PAIRINGS = ("best_worst", "all")


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
    tb_logz: str = "vargrad"
    """TB: 'vargrad' (per-prompt batch estimate, the paper's). 'learned' (a logZ per prompt owned
    by the learner) exists in the loss but a run refuses it (tasks/fit.py): no learner owns one."""

    reward_map: str = "auto"
    """TOPR: how task rewards become TOPR's rewards. pm1: R in the declared [low, high] maps
    linearly to [−1, +1] (the paper's ±1; 0/1 rewards become −1/+1), and topr_baseline /
    topr_positive_threshold are in those units. none: raw rewards, baseline and threshold in the
    task's units. auto: none when the task's range is already [−1, 1], pm1 when the baseline and
    threshold are left at 0, refused otherwise (the units they are in would be a guess)."""
    reward_range: list[float] = dataclasses.field(default_factory=list)
    """[low, high] of the task's rewards, filled in at composition from the task's declaration
    (hpc_tba.tasks.reward_range); empty = undeclared."""

    topr_baseline: float = 0.0
    """TOPR: baseline c subtracted from rewards (R − c); sets the effective positive fraction."""
    topr_pos_min: float = 1.0
    """TOPR: lower clip of the importance ratio for samples with reward >= 0 (TOPR: 1)."""
    topr_pos_max: float = 1.0
    """TOPR: upper clip of the ratio for reward >= 0 (TOPR: 1 = plain SFT on positives)."""
    topr_neg_min: float = 0.0
    """TOPR: lower clip of the ratio for reward < 0 (TOPR: 0)."""
    topr_neg_max: float = 1.0
    """TOPR: upper clip of the ratio for reward < 0 (TOPR: 1 = truncated IS, tapers to 0)."""
    topr_length_normalize: bool = True
    """TOPR: divide each sample's loss by its response length |y|."""
    topr_positive_threshold: float = 0.0
    """TOPR: rewards >= this are positives (0 for ±1 rewards; 0.5 with baseline 0.5 for 0/1 rewards)."""

    alol_variant: str = "a_lol"
    """A-LoL: one of a_lol, ref_free, seq, kl, r_lol (ALGORITHMS.md §3)."""
    alol_clip_eps: float = 0.9
    """A-LoL: importance weights clipped to [1 − ε, 1 + ε] (0.9 gives [0.1, 1.9])."""
    alol_kl_beta: float = 0.0
    """A-LoL KL variant: coefficient of (log π_θ − log π_ref); must be > 0 for variant=kl."""

    grpo_clip_eps: float = 0.2
    """GRPO: PPO clip range of the per-token ratio to the behaviour policy."""
    grpo_scale_std: bool = True
    """GRPO: divide group-centred rewards by the group std (False = Dr. GRPO's centring only)."""
    kl_coef: float = 0.0
    """GRPO/RLOO: weight of the KL penalty to the reference (0 = no reference model needed)."""

    dpo_beta: float = 0.1
    """DPO: inverse temperature of the implicit reward β·(log π_θ − log π_ref)."""
    dpo_pairing: str = "best_worst"
    """DPO: pairs per prompt group: 'best_worst' (one pair) or 'all' (every higher/lower pair)."""

    sft_min_reward: float = 0.0
    """SFT (rejection sampling): train on samples with reward > this (-inf keeps every sample)."""
    length_normalize: bool = False
    """RLOO/SFT: divide each sample's summed log-prob by its length (False: sum, as RLOO's paper)."""

    def __post_init__(self) -> None:
        if self.name not in ALGOS:
            raise ValueError(f"algo.name={self.name!r} is not one of {', '.join(ALGOS)}")
        if self.beta0 <= 0 or self.beta_final <= 0:
            raise ValueError("algo.beta0 and algo.beta_final must be > 0 (β divides the reward)")
        if self.beta_steps < 0:
            raise ValueError("algo.beta_steps must be >= 0")
        if self.tb_logz not in TB_LOGZ:
            raise ValueError(f"algo.tb_logz={self.tb_logz!r} is not one of {', '.join(TB_LOGZ)}")
        if self.reward_map not in REWARD_MAPS:
            raise ValueError(f"algo.reward_map={self.reward_map!r} is not one of {', '.join(REWARD_MAPS)}")
        if self.reward_range and (len(self.reward_range) != 2 or
                                  not float(self.reward_range[0]) < float(self.reward_range[1])):
            raise ValueError(f"algo.reward_range={list(self.reward_range)} must be [low, high], low < high")
        for kind in ("pos", "neg"):
            lo, hi = getattr(self, f"topr_{kind}_min"), getattr(self, f"topr_{kind}_max")
            if not (0.0 <= lo <= hi) or math.isnan(hi):
                raise ValueError(f"algo.topr_{kind}_min/max must satisfy 0 <= min <= max (got {lo}, {hi}); "
                                 "they clip an importance ratio")
        if self.alol_variant not in ALOL_VARIANTS:
            raise ValueError(f"algo.alol_variant={self.alol_variant!r} is not one of {', '.join(ALOL_VARIANTS)}")
        if not 0.0 <= self.alol_clip_eps < 1.0:
            raise ValueError(f"algo.alol_clip_eps must be in [0, 1) so weights stay positive, got {self.alol_clip_eps}")
        if self.alol_kl_beta < 0:
            raise ValueError("algo.alol_kl_beta must be >= 0")
        if self.name == "alol" and self.alol_variant == "kl" and self.alol_kl_beta <= 0:
            raise ValueError("algo.alol_variant=kl needs algo.alol_kl_beta > 0 (else it is ref_free on A+)")
        if not 0.0 < self.grpo_clip_eps < 1.0:
            raise ValueError(f"algo.grpo_clip_eps must be in (0, 1), got {self.grpo_clip_eps}")
        if self.kl_coef < 0:
            raise ValueError("algo.kl_coef must be >= 0")
        if self.dpo_beta <= 0:
            raise ValueError("algo.dpo_beta must be > 0")
        if self.dpo_pairing not in DPO_PAIRINGS:
            raise ValueError(f"algo.dpo_pairing={self.dpo_pairing!r} is not one of {', '.join(DPO_PAIRINGS)}")
        if math.isnan(self.sft_min_reward):
            raise ValueError("algo.sft_min_reward must be a number (use -inf to keep every sample)")

    @property
    def needs_reference(self) -> bool:
        """Whether the learner must compute log-probs under the frozen reference policy."""
        if self.name in ("tb", "dpo"):
            return True
        if self.name == "alol":
            return self.alol_variant != "ref_free"
        if self.name in ("grpo", "rloo"):
            return self.kl_coef > 0
        return False  # topr, sft

    @property
    def needs_advantages(self) -> bool:
        """Whether samples must carry a precomputed advantage A = R − V(x) (A-LoL, except R-LoL)."""
        return self.name == "alol" and self.alol_variant != "r_lol"

    def beta(self, step: int) -> float:
        """β at learner step `step`: linear from beta0 to beta_final over beta_steps, then constant."""
        if self.beta_steps == 0 or step >= self.beta_steps:
            return self.beta_final
        return self.beta0 + (self.beta_final - self.beta0) * step / self.beta_steps

    def topr_rewards(self, rewards):
        """TOPR's rewards from the task's (a tensor or array): mapped to [−1, 1] under
        reward_map=pm1 (low -> −1, high -> +1), unchanged under none."""
        if self.reward_map != "pm1":
            return rewards
        low, high = (float(v) for v in self.reward_range)
        return (rewards - low) * (2.0 / (high - low)) - 1.0

    def fit_rewards(self, task_range: tuple[float, float] | None, *, task: str) -> LossConfig:
        """This config with reward_map resolved against the task's declared reward range (and
        algo.reward_range filled in); raises ValueError when TOPR's split would be ill-defined."""
        rng = (float(self.reward_range[0]), float(self.reward_range[1])) if self.reward_range else task_range
        stored = list(rng) if rng is not None else []
        if self.name != "topr":
            if self.reward_map == "pm1":
                raise ValueError(f"algo.reward_map=pm1 sets TOPR's ±1 rewards; algo={self.name} uses "
                                 "the task's rewards as they are: use algo.reward_map=auto or none")
            return dataclasses.replace(self, reward_map="none", reward_range=stored)
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
