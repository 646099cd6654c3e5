"""The task interface: prompts with ids and splits, a batched reward, evaluation metrics."""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: int
    """Index in its split (train ids are the routing key of the replay buffer)."""
    text: str
    """The prompt exactly as fed to the model (already formatted)."""
    answer: str = ""
    """Reference answer, for tasks with a verifiable reward."""


@dataclasses.dataclass(frozen=True)
class RewardRange:
    """The rewards a task can give: every reward lies in [low, high]."""

    low: float
    high: float
    binary: bool = False
    """Only the two ends occur (exact-match rewards: 0 or 1)."""

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"reward range needs low < high, got [{self.low}, {self.high}]")


BINARY = RewardRange(0.0, 1.0, binary=True)
"""Exact-match rewards: 1 if correct, else 0."""


class Task(abc.ABC):
    """A source of prompts and a reward. Implementations must be deterministic given their config."""

    name: str = "task"
    reward_range: RewardRange | None = None
    """The rewards `score` gives (None: unbounded or unknown, e.g. a reward model's logit)."""
    formatter: Callable[[str], str] | None = None
    """Applied to every prompt text (tasks.chat.PromptFormatter; set by build_task)."""
    device: str | None = None
    """The caller's device (the searcher's): where reward/victim models go under
    task.reward_device=auto. None: cuda when available, else cpu."""

    def format_prompts(self, prompts: list[Prompt]) -> list[Prompt]:
        """Prompts with their text as the model expects it (chat template, BOS once)."""
        if self.formatter is None:
            return prompts
        return [dataclasses.replace(p, text=self.formatter(p.text)) for p in prompts]

    def round_metrics(self, prompts: Sequence[Prompt], responses: Sequence[str],
                      rewards: np.ndarray) -> dict[str, float]:
        """Task-specific scalars of one generation round, logged by the searcher (none here)."""
        return {}

    @abc.abstractmethod
    def prompts(self, split: str) -> list[Prompt]:
        """The prompts of `split` ("train" or "test"), ids 0..n-1."""

    @abc.abstractmethod
    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> np.ndarray:
        """[N] float32 rewards for N (prompt, response) pairs. Must not raise for odd responses."""

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> tuple[np.ndarray, int]:
        """Batched reward that survives a failing scorer: (rewards, number of failed samples).

        If the batched scorer raises, samples are scored one by one; a sample whose scoring
        raises gets `failure_reward` and is counted, and the run goes on.
        """
        try:
            return np.asarray(self.score(prompts, responses), dtype=np.float32), 0
        except Exception:
            out, failed = np.empty(len(responses), dtype=np.float32), 0
            for i, (p, r) in enumerate(zip(prompts, responses)):
                try:
                    out[i] = float(self.score([p], [r])[0])
                except Exception:
                    out[i], failed = self.failure_reward, failed + 1
            return out, failed

    failure_reward: float = 0.0
    """Reward given to a sample whose scoring raised."""

    def correct(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> np.ndarray:
        """[N] bool: is each response correct (pass@k's notion of success)."""
        return self.rewards(prompts, responses)[0] > 0.5
