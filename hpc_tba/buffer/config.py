"""Typed configuration of the replay buffer (`buffer=` group)."""
from __future__ import annotations

import dataclasses

SAMPLERS = ("tba", "uniform", "advantage")


@dataclasses.dataclass
class BufferConfig:
    """Replay buffer: one shard per learner rank; defaults are TBA's GSM8K run."""

    sampler: str = "tba"
    """tba (recency with prob. m, else reward priority), uniform, or advantage (A-LoL, ∝ max(A,0))."""
    recency_m: float = 0.95
    """Probability that a prompt slot takes a prompt refreshed since the latest sync."""
    inv_temp: float = 0.0
    """Reward-priority sampling: softmax(inv_temp * reward) over a prompt's samples (0 = uniform)."""
    per_prompt_capacity: int = 100
    """Most responses kept per prompt (oldest dropped first); exact duplicates are removed."""
    capacity: int = 0
    """Global cap on stored responses per shard; 0 = unbounded."""
    warm_start: int = 500
    """Responses a shard must hold before its learner takes the first step."""

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"buffer.sampler={self.sampler!r} is not one of {', '.join(SAMPLERS)}")
        if not 0.0 <= self.recency_m <= 1.0:
            raise ValueError(f"buffer.recency_m={self.recency_m} must be in [0, 1]")
        if self.per_prompt_capacity < 1:
            raise ValueError("buffer.per_prompt_capacity must be >= 1")
        if self.capacity < 0 or self.warm_start < 0:
            raise ValueError("buffer.capacity and buffer.warm_start must be >= 0")
