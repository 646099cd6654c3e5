"""GSM8K and MATH from local files in their public formats, with an exact-match final-answer reward.

- GSM8K rows: `{"question": str, "answer": str}`, the answer's last line `#### <number>`.
- MATH rows: `{"problem": str, "solution": str, "level": str, "type": str}`, the final answer in the
  solution's last `\\boxed{...}`. A string `answer` field, when present (as in MATH-500), is used
  instead of the boxed one. `level`/`type` are optional but must be strings (or, for `level`, an
  int) when present.

Files are found by `task.path` (see `tasks.layout`): a directory holding `train.jsonl` /
`test.jsonl` (or `.json`, `.parquet`, `.arrow`, `.csv`, Hugging Face `train-00000-of-00001.parquet`
shards, or the original MATH archive's `train/<type>/<n>.json`), a hub download of openai/gsm8k
(`main/train-00000-of-00001.parquet`; task.subset picks main or socratic), a `datasets`
save_to_disk folder, a path with `{split}` in it, or one file that serves every split. Columns
named otherwise are mapped with task.columns (e.g. task.columns.question=problem). Prompts use
TBA's format `[MATH TASK] Problem:\\n{question}\\n\\nSolution:\\n`
(`task.prompt_template`). Reward 1.0 if the answer extracted from the response equals the
reference (tasks.math_answers: exact rationals, no eval of model output), else 0.0.

Splits load lazily (a searcher never reads the test split) and are cached; bad rows raise
DataError naming the file, line and field.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hpc_tba.config import TaskConfig
from hpc_tba.tasks.base import BINARY, Prompt, Task
from hpc_tba.tasks.layout import task_rows
from hpc_tba.tasks.math_answers import (
    answers_equal,
    extract_answer,
    extract_boxed,
    gsm8k_reference,
    normalize_answer,
    parse_number,
)
from hpc_tba.tasks.records import DataError, Row, get_str

STOP_MARKER = "[MATH TASK]"
"""A response that goes on to pose a new problem is cut here before its answer is read."""


class MathTask(Task):
    """Hendrycks MATH: competition problems with a `\\boxed{}` final answer."""

    name = "math"
    reward_range = BINARY
    question_field = "problem"

    def __init__(self, cfg: TaskConfig):
        if not cfg.path:
            raise ValueError(f"task {self.name!r} reads local files: set task.path to the data "
                             "directory or file (e.g. task.path=/data/gsm8k)")
        self.cfg = cfg
        self._splits: dict[str, list[Prompt]] = {}

    def prompts(self, split: str) -> list[Prompt]:
        if split not in self._splits:
            self._splits[split] = self.format_prompts(self._load(split))
        return self._splits[split]

    def _load(self, split: str) -> list[Prompt]:
        out: list[Prompt] = []
        for path, line, row in task_rows(self.cfg, split):
            question = get_str(path, line, row, self.question_field)
            text = self.cfg.prompt_template.replace("{question}", question)
            out.append(Prompt(len(out), text, self.reference(path, line, row)))
            if self.cfg.max_prompts and len(out) >= self.cfg.max_prompts:
                return out  # streamed: the rest of the files is never read
        return out

    def reference(self, path: Path, line: int, row: Row) -> str:
        """The reference final answer of one data row (raises DataError if it has none)."""
        for field in ("level", "type"):
            if field in row and not isinstance(row[field], (str, int)):
                raise DataError(path, f"expected a string, got {type(row[field]).__name__}",
                                line=line, field=field)
        if "answer" in row:
            return get_str(path, line, row, "answer").strip()
        solution = get_str(path, line, row, "solution")
        boxed = extract_boxed(solution)
        if boxed is None or not boxed.strip():
            raise DataError(path, "has no \\boxed{...} final answer", line=line, field="solution")
        return boxed.strip()

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> np.ndarray:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return np.array([float(answers_equal(self.answer_of(r), p.answer))
                         for p, r in zip(prompts, responses)], dtype=np.float32)

    @staticmethod
    def answer_of(response: str) -> str | None:
        """The final answer a response commits to (None if it states none)."""
        return extract_answer(response.split(STOP_MARKER, 1)[0])

    def canonical_answer(self, response: str) -> str | None:
        """The final answer in canonical form, so that maj@k counts `0.5` and `\\frac{1}{2}` as one
        answer: an exact rational when it is a number, else the normalised string."""
        answer = self.answer_of(response)
        if answer is None:
            return None
        norm = normalize_answer(answer)
        value = parse_number(norm)
        return str(value) if value is not None else (norm or None)


class GSM8KTask(MathTask):
    """GSM8K grade-school word problems; the reference is the number after `####`."""

    name = "gsm8k"
    question_field = "question"

    def reference(self, path: Path, line: int, row: Row) -> str:
        answer = get_str(path, line, row, "answer")
        final = gsm8k_reference(answer)
        if final is None:
            raise DataError(path, "has no final '#### <number>' line", line=line, field="answer")
        return final
