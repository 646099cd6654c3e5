"""Typed configuration of the task (`task=` group)."""
from __future__ import annotations

import dataclasses

from hpc_tba.config.ranges import SEED_NOTE, check_ranges, ranged

FILE_TASKS = ("gsm8k", "math", "offline", "preference", "redteam")
"""Tasks that read the user's files and so need `task.path`."""
CHAT_TEMPLATE = {"false": "off", "off": "off", "no": "off", "true": "on", "on": "on", "yes": "on",
                 "auto": "auto"}
"""Spellings `task.chat_template` accepts (yaml booleans arrive as "True"/"False"), normalised."""
TASK_COLUMNS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("question", "answer"),
    "math": ("problem", "solution", "answer", "level", "type"),
    "preference": ("prompt", "reference"),
    "redteam": ("prompt", "answer"),
    "offline": ("prompt", "response", "reward", "logp_behavior", "logp_ref", "advantage",
                "logp_temperature"),
}
"""The fields each file-backed task reads from a row (the keys `task.columns` may map)."""
REWARD_DEVICES = ("auto", "cpu", "cuda")
REWARD_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclasses.dataclass
class TaskConfig:
    """Prompts, reward and evaluation. `arithmetic` is the embedded task that needs no files."""

    name: str = "arithmetic"
    """Task name (see hpc_tba.tasks.TASKS)."""
    num_train: int = ranged(2000, ge=1)
    """arithmetic: number of training prompts generated."""
    num_test: int = ranged(200, ge=1)
    """arithmetic: number of held-out prompts (disjoint from training)."""
    max_operand: int = ranged(49, ge=1)
    """arithmetic: operands are drawn from [0, max_operand]."""
    seed: int = ranged(1234, ge=0, note=SEED_NOTE)
    """Seed of the generated data set."""
    path: str = ""
    """Data file or directory for file-backed tasks: a file, a `{split}` path, or a folder in the
    hub's / datasets' layouts (a hub download or cache entry, save_to_disk output; tasks.layout)."""
    subset: str = ""
    """The config sub-folder to read where the data set has several (openai/gsm8k: main or
    socratic); empty = the only one holding the split. Ignored by a data set without them."""
    split_train: str = "train"
    """Name of the data set's split that training reads (prompts("train"))."""
    split_test: str = "test"
    """Name of the data set's split that evaluation reads (e.g. validation, test)."""
    columns: dict[str, str] = dataclasses.field(default_factory=dict)
    """Task field -> the data's column name, e.g. task.columns.question=problem; fields per task
    in TASK_COLUMNS. Checked against the first row when the task is built."""
    prompt_template: str = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"
    """gsm8k, math: how a question becomes a prompt; `{question}` is replaced (TBA's format)."""
    max_prompts: int = ranged(0, ge=0, note="0: all prompts")
    """File-backed tasks: use only the first N prompts of each split (0 = all)."""
    reward_model: str = ""
    """preference: local HF sequence-classification reward model; redteam: toxicity classifier."""
    reward_label: int = ranged(0, ge=0)
    """preference, redteam: which output of the reward model / classifier is the score (toxic)."""
    reward_batch_size: int = ranged(16, ge=1)
    """preference, redteam: texts per reward-model / classifier forward pass."""
    reward_max_length: int = ranged(1024, ge=1)
    """preference: tokens of prompt + response the reward model sees (cut from the left)."""
    unfinished_penalty: float = ranged(1.0, ge=0, note="it is subtracted")
    """preference: subtracted from the reward of a response that hit the length limit."""
    victim_model: str = ""
    """redteam: local Hugging Face causal LM that answers the attacks."""
    victim_max_new_tokens: int = ranged(32, ge=1)
    """redteam: length of the victim's (greedy) answer."""
    curation: str = "none"
    """offline: `none`, or `anna_karenina` (TOPR: first correct response per prompt + all wrong)."""
    chat_template: str = "off"
    """Wrap each prompt in the tokenizer's own chat template (a user turn, then the generation
    prompt): off, on (refused if the tokenizer has none), or auto (when it has one)."""
    system_prompt: str = ""
    """With a chat template: a system turn put before every prompt (empty = none)."""
    reward_range: list[float] = dataclasses.field(default_factory=list)
    """Declared [low, high] of the rewards; empty = the task's own declaration (tasks.reward_range:
    {0, 1} for exact match, [0, 1] for P(toxic)). Offline files must declare it for TOPR."""
    reward_device: str = "auto"
    """preference, redteam: device of the reward / classifier / victim models: auto (the
    searcher's own device), cpu or cuda."""
    reward_dtype: str = "auto"
    """preference, redteam: their dtype: auto (bfloat16 on cuda, float32 on cpu), float32,
    bfloat16 or float16."""

    def __post_init__(self) -> None:
        check_ranges(self, "task")
        if self.name in FILE_TASKS and not self.path:
            raise ValueError(f"task {self.name!r} reads local files: set task.path to the data "
                             "directory or file (e.g. task.path=/data/gsm8k)")
        if self.columns:
            fields = TASK_COLUMNS.get(self.name)
            if fields is None:
                raise ValueError(f"task.columns is set but task {self.name!r} reads no files")
            unknown = sorted(set(self.columns) - set(fields))
            if unknown:
                raise ValueError(f"task.columns.{unknown[0]}: task {self.name!r} has no field "
                                 f"{unknown[0]!r}; its fields are {', '.join(fields)}")
            empty = sorted(k for k, v in self.columns.items() if not str(v).strip())
            if empty:
                raise ValueError(f"task.columns.{empty[0]} is empty: name the data's column")
        if not str(self.split_train).strip() or not str(self.split_test).strip():
            raise ValueError("task.split_train and task.split_test must name splits (e.g. train, "
                             "test, validation)")
        if "{question}" not in self.prompt_template:
            raise ValueError("task.prompt_template must contain `{question}` (where the question "
                             "goes)")
        if self.name in ("preference", "redteam") and not self.reward_model:
            raise ValueError(f"task {self.name!r} needs task.reward_model: a local Hugging Face "
                             "sequence-classification checkpoint directory")
        if self.name == "redteam" and not self.victim_model:
            raise ValueError("task 'redteam' needs task.victim_model: a local causal LM directory")
        if self.curation not in ("none", "anna_karenina"):
            raise ValueError(f"task.curation={self.curation!r} must be `none` or `anna_karenina`")
        mode = CHAT_TEMPLATE.get(str(self.chat_template).strip().lower())
        if mode is None:
            raise ValueError(f"task.chat_template={self.chat_template!r} must be on, off or auto")
        self.chat_template = mode
        if self.system_prompt and mode == "off":
            raise ValueError("task.system_prompt is set but task.chat_template=off: a system turn "
                             "needs the chat template (task.chat_template=on or auto)")
        if self.reward_range and (len(self.reward_range) != 2 or not
                                  float(self.reward_range[0]) < float(self.reward_range[1])):
            raise ValueError(f"task.reward_range={list(self.reward_range)} must be [low, high] with "
                             "low < high")
        if self.reward_device not in REWARD_DEVICES and not self.reward_device.startswith("cuda:"):
            raise ValueError(f"task.reward_device={self.reward_device!r} must be auto, cpu, cuda "
                             "or cuda:N")
        if self.reward_dtype not in REWARD_DTYPES:
            raise ValueError(f"task.reward_dtype={self.reward_dtype!r} is not one of "
                             f"{', '.join(REWARD_DTYPES)}")
