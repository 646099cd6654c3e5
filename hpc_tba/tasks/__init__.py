"""Tasks: prompts, rewards and evaluation, selected by `task.name`."""
from __future__ import annotations

from collections.abc import Callable

from hpc_tba.tasks.arithmetic import ArithmeticTask
from hpc_tba.tasks.base import Prompt, Task
from hpc_tba.tasks.config import TaskConfig

TASKS: dict[str, Callable[[TaskConfig], Task]] = {"arithmetic": ArithmeticTask}


def build_task(cfg: TaskConfig) -> Task:
    if cfg.name not in TASKS:
        raise ValueError(f"task.name={cfg.name!r} is not one of {', '.join(sorted(TASKS))}")
    return TASKS[cfg.name](cfg)


__all__ = ["Prompt", "Task", "TaskConfig", "TASKS", "build_task"]
