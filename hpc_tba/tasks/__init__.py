"""Tasks: prompts, rewards and evaluation, selected by `task.name`."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpc_tba.config import TaskConfig
from hpc_tba.tasks.arithmetic import ArithmeticTask
from hpc_tba.tasks.base import Prompt, RewardRange, Task
from hpc_tba.tasks.chat import PromptFormatter
from hpc_tba.tasks.layout import check_columns
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


def build_task(cfg: TaskConfig, *, tokenizer: Any = None, device: str | None = None) -> Task:
    """The task of `cfg`. `tokenizer` (a tokenizer or the model's directory) formats prompts when
    task.chat_template is on/auto; `device` is the caller's device (the searcher's), where
    reward and victim models go under task.reward_device=auto. A file-backed task's data is
    checked against task.columns and its fields on the first row (tasks.layout.check_columns)."""
    if cfg.name not in TASKS:
        raise ValueError(f"task.name={cfg.name!r} is not one of {', '.join(sorted(TASKS))}")
    check_columns(cfg)
    if cfg.chat_template != "off" and tokenizer is None:
        raise ValueError(f"task.chat_template={cfg.chat_template} needs the model's tokenizer to "
                         "format prompts: build_task(cfg, tokenizer=<model directory>)")
    task = TASKS[cfg.name](cfg)
    if cfg.chat_template != "off":
        formatter = PromptFormatter(cfg, tokenizer)
        task.formatter = formatter if formatter.active else None
    if device is not None:
        task.device = device
    return task


def reward_range(cfg: TaskConfig) -> RewardRange | None:
    """The declared range of the task's rewards, without building the task (config time):
    task.reward_range if set, else the task's own declaration."""
    if cfg.reward_range:
        return RewardRange(float(cfg.reward_range[0]), float(cfg.reward_range[1]))
    cls = TASKS.get(cfg.name)
    return None if cls is None else cls.reward_range


__all__ = ["Prompt", "RewardRange", "Task", "TASKS", "build_task", "check_columns", "reward_range"]
