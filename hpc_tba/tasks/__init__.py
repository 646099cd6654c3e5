"""Tasks: prompts, rewards and evaluation, selected by `task.name`."""
from __future__ import annotations

from collections.abc import Callable

from hpc_tba.tasks.arithmetic import ArithmeticTask
from hpc_tba.tasks.base import Prompt, Task
from hpc_tba.tasks.config import TaskConfig
from hpc_tba.tasks.math import GSM8KTask, MathTask
from hpc_tba.tasks.offline import OfflineTask
from hpc_tba.tasks.preference import PreferenceTask
from hpc_tba.tasks.redteam import RedTeamTask

TASKS: dict[str, Callable[[TaskConfig], Task]] = {
    "arithmetic": ArithmeticTask,
    "gsm8k": GSM8KTask,
    "math": MathTask,
    "offline": OfflineTask,
    "preference": PreferenceTask,
    "redteam": RedTeamTask,
}


def build_task(cfg: TaskConfig) -> Task:
    if cfg.name not in TASKS:
        raise ValueError(f"task.name={cfg.name!r} is not one of {', '.join(sorted(TASKS))}")
    return TASKS[cfg.name](cfg)


__all__ = ["Prompt", "Task", "TaskConfig", "TASKS", "build_task"]
