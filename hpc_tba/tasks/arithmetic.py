"""The embedded task: two-number addition with an exact, verifiable reward.

Prompts look like `37+58=`; the correct response is `95` followed by end-of-sequence. Reward 1 for
an exact match of the stripped response, else 0 (GSM8K's exact-match reward in miniature).
Train and test prompts are disjoint operand pairs drawn with a fixed seed.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpc_tba.config import TaskConfig
from hpc_tba.tasks.base import BINARY, Prompt, Task


class ArithmeticTask(Task):
    name = "arithmetic"
    reward_range = BINARY

    def __init__(self, cfg: TaskConfig):
        n = cfg.max_operand + 1
        if cfg.num_train + cfg.num_test > n * n:
            raise ValueError(f"task asks for {cfg.num_train + cfg.num_test} distinct prompts but "
                             f"max_operand={cfg.max_operand} allows only {n * n}")
        rng = np.random.default_rng(cfg.seed)
        pairs = rng.choice(n * n, size=cfg.num_train + cfg.num_test, replace=False)
        make = [Prompt(i, f"{p // n}+{p % n}=", str(p // n + p % n)) for i, p in enumerate(pairs)]
        self._splits = {
            "train": make[: cfg.num_train],
            "test": [Prompt(i, p.text, p.answer) for i, p in enumerate(make[cfg.num_train:])],
        }
        self._formatted: dict[str, list[Prompt]] = {}

    def prompts(self, split: str) -> list[Prompt]:
        if split not in self._splits:
            raise ValueError(f"arithmetic task has no split {split!r} (train, test)")
        if self.formatter is not None and split not in self._formatted:
            self._formatted[split] = self.format_prompts(self._splits[split])
        return self._formatted[split] if self.formatter is not None else self._splits[split]

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> np.ndarray:
        return np.array([float(r.strip() == p.answer) for p, r in zip(prompts, responses)],
                        dtype=np.float32)

    @staticmethod
    def sft_text(prompt: Prompt) -> str:
        """Supervised warm-start target: prompt followed by its answer."""
        return prompt.text + prompt.answer
