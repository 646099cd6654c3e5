"""Typed configuration of the task (`task=` group)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TaskConfig:
    """Prompts, reward and evaluation. `arithmetic` is the embedded task that needs no files."""

    name: str = "arithmetic"
    """Task name (see hpc_tba.tasks.TASKS)."""
    num_train: int = 2000
    """arithmetic: number of training prompts generated."""
    num_test: int = 200
    """arithmetic: number of held-out prompts (disjoint from training)."""
    max_operand: int = 99
    """arithmetic: operands are drawn from [0, max_operand]."""
    seed: int = 1234
    """Seed of the generated data set."""
    path: str = ""
    """Data file or directory for file-backed tasks."""

    def __post_init__(self) -> None:
        if self.num_train < 1 or self.num_test < 1:
            raise ValueError("task.num_train and task.num_test must be >= 1")
        if self.max_operand < 1:
            raise ValueError("task.max_operand must be >= 1")
