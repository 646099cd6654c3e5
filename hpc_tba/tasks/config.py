"""Typed configuration of the task (`task=` group)."""
from __future__ import annotations

import dataclasses

FILE_TASKS = ("gsm8k", "math", "offline", "preference", "redteam")
"""Tasks that read the user's files and so need `task.path`."""


@dataclasses.dataclass
class TaskConfig:
    """Prompts, reward and evaluation. `arithmetic` is the embedded task that needs no files."""

    name: str = "arithmetic"
    """Task name (see hpc_tba.tasks.TASKS)."""
    num_train: int = 2000
    """arithmetic: number of training prompts generated."""
    num_test: int = 200
    """arithmetic: number of held-out prompts (disjoint from training)."""
    max_operand: int = 49
    """arithmetic: operands are drawn from [0, max_operand]."""
    seed: int = 1234
    """Seed of the generated data set."""
    path: str = ""
    """Data file or directory for file-backed tasks (gsm8k, math: see tasks.records.split_files)."""
    prompt_template: str = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"
    """gsm8k, math: how a question becomes a prompt; `{question}` is replaced (TBA's format)."""
    max_prompts: int = 0
    """File-backed tasks: use only the first N prompts of each split (0 = all)."""
    reward_model: str = ""
    """preference: local HF sequence-classification reward model; redteam: toxicity classifier."""
    reward_label: int = 0
    """preference, redteam: which output of the reward model / classifier is the score (toxic)."""
    reward_batch_size: int = 16
    """preference, redteam: texts per reward-model / classifier forward pass."""
    reward_max_length: int = 1024
    """preference: tokens of prompt + response the reward model sees (cut from the left)."""
    unfinished_penalty: float = 1.0
    """preference: subtracted from the reward of a response that hit the length limit."""
    victim_model: str = ""
    """redteam: local Hugging Face causal LM that answers the attacks."""
    victim_max_new_tokens: int = 32
    """redteam: length of the victim's (greedy) answer."""
    curation: str = "none"
    """offline: `none`, or `anna_karenina` (TOPR: first correct response per prompt + all wrong)."""

    def __post_init__(self) -> None:
        if self.num_train < 1 or self.num_test < 1:
            raise ValueError("task.num_train and task.num_test must be >= 1")
        if self.max_operand < 1:
            raise ValueError("task.max_operand must be >= 1")
        if self.name in FILE_TASKS and not self.path:
            raise ValueError(f"task {self.name!r} reads local files: set task.path to the data "
                             "directory or file (e.g. task.path=/data/gsm8k)")
        if "{question}" not in self.prompt_template:
            raise ValueError("task.prompt_template must contain `{question}` (where the question "
                             "goes)")
        if self.name in ("preference", "redteam") and not self.reward_model:
            raise ValueError(f"task {self.name!r} needs task.reward_model: a local Hugging Face "
                             "sequence-classification checkpoint directory")
        if self.name == "redteam" and not self.victim_model:
            raise ValueError("task 'redteam' needs task.victim_model: a local causal LM directory")
        if self.victim_max_new_tokens < 1 or self.reward_label < 0:
            raise ValueError("task.victim_max_new_tokens must be >= 1 and task.reward_label >= 0")
        if self.reward_batch_size < 1 or self.reward_max_length < 1:
            raise ValueError("task.reward_batch_size and task.reward_max_length must be >= 1")
        if self.unfinished_penalty < 0:
            raise ValueError("task.unfinished_penalty must be >= 0 (it is subtracted)")
        if self.curation not in ("none", "anna_karenina"):
            raise ValueError(f"task.curation={self.curation!r} must be `none` or `anna_karenina`")
        if self.max_prompts < 0:
            raise ValueError("task.max_prompts must be >= 0 (0 = all prompts)")
