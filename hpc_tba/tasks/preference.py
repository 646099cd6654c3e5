"""Preference tuning (TBA's TL;DR setting): reward = a reward model's score of prompt + response.

- Reward model: a local Hugging Face sequence-classification checkpoint (`task.reward_model`),
  e.g. a Pythia or Llama reward model with one output; scored on the searcher side in batches of
  `task.reward_batch_size`. The text scored is `prompt + response` (the prompt is already formatted,
  as in TL;DR's "...\\nTL;DR:"). Inputs longer than `task.reward_max_length` tokens are cut from the
  left so the response's end, which the reward model must see, survives.
- Responses that never end: TBA (after the asynchronous online-DPO code it builds on) subtracts a
  penalty from the reward of a response cut off at the length limit, so that the policy does not
  learn to ramble. The text alone cannot tell whether generation stopped, so the caller passes
  `finished` (vLLM's finish_reason == "stop") to `rewards(..., finished=...)`;
  `task.unfinished_penalty` (default 1.0 [unverified]) is subtracted where it is False.
- Data: a split in any layout tasks.layout reads (`train.jsonl`, a hub download's parquet shards)
  with rows `{"prompt": str, "reference": str?}`; `reference` is a human-written response used by
  `win_rate`. Other column names are mapped with task.columns (trl-lib/tldr's
  `task.columns.reference=completion`); `hpc-tba data tldr` converts the other TL;DR layouts.
- `win_rate`: fraction of prompts where the policy's response scores above the reference (ties
  count half), the reward model acting as judge. A separate judge model is not wired here.

torch and transformers are imported when a reward model is loaded, not when this module is.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hpc_tba.config import TaskConfig
from hpc_tba.tasks.base import Prompt, Task
from hpc_tba.tasks.chat import ensure_pad_token
from hpc_tba.tasks.layout import task_rows
from hpc_tba.tasks.records import DataError, get_str


def reward_placement(cfg: TaskConfig, caller_device: str | None) -> tuple[str, str]:
    """(device, dtype name) for reward / classifier / victim models under task.reward_device and
    task.reward_dtype: auto = the caller's device (the searcher's; without one, cuda when
    available), bfloat16 on cuda and float32 on cpu — never an implicit CPU fp32 on a GPU searcher."""
    device = cfg.reward_device
    if device == "auto":
        if caller_device is None:
            import torch

            caller_device = "cuda" if torch.cuda.is_available() else "cpu"
        device = caller_device
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"task.reward_device={cfg.reward_device} resolved to {device}, but this "
                             "process sees no CUDA device")
    dtype = cfg.reward_dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


class RewardModel:
    """A local sequence-classification checkpoint as a batched scorer of texts (no gradients)."""

    def __init__(self, path: str, *, batch_size: int = 16, max_length: int = 1024,
                 device: str = "cpu", label: int = 0, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from hpc_tba.models.construction import building

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.truncation_side = "left"  # keep the end of the response
        ensure_pad_token(self.tokenizer, f"reward model {path}")
        with building():  # hpc_tba.models.construction: one model built at a time per process
            self.model: Any = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=getattr(torch, dtype)).to(device).eval()
        if self.model.config.pad_token_id is None:  # needed to find each row's last real token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if not 0 <= label < self.model.config.num_labels:
            raise ValueError(f"reward model {path} has {self.model.config.num_labels} outputs; "
                             f"label {label} does not exist")
        self.batch_size, self.max_length, self.label = batch_size, max_length, label
        self.device = device
        self._torch = torch

    def logits(self, texts: Sequence[str]) -> np.ndarray:
        """[N, num_labels] float32 output logits of N texts, in batches."""
        out = np.empty((len(texts), self.model.config.num_labels), dtype=np.float32)
        with self._torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = list(texts[start:start + self.batch_size])
                enc = self.tokenizer(batch, padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt")
                enc = enc.to(self.device)
                out[start:start + len(batch)] = self.model(**enc).logits.float().cpu().numpy()
        return out

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        """[N] float32 scores: the chosen output's logit (a reward model's reward)."""
        return self.logits(texts)[:, self.label]

    def probability(self, texts: Sequence[str]) -> np.ndarray:
        """[N] probability of the chosen label (a classifier's, e.g. toxicity): sigmoid of the
        logit for a one-output model, softmax over outputs otherwise."""
        z = self.logits(texts).astype(np.float64)
        if z.shape[1] == 1:
            return (1.0 / (1.0 + np.exp(-z[:, 0]))).astype(np.float32)
        z = z - z.max(axis=1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        return p[:, self.label].astype(np.float32)


def load_prompts(cfg: TaskConfig, split: str, *, answer_field: str) -> list[Prompt]:
    """Rows `{"prompt": str, <answer_field>: str?}` of a split (columns mapped by task.columns),
    as Prompts (ids 0..n-1)."""
    out: list[Prompt] = []
    for path, line, row in task_rows(cfg, split):
        answer = get_str(path, line, row, answer_field) if answer_field in row else ""
        out.append(Prompt(len(out), get_str(path, line, row, "prompt"), answer))
        if cfg.max_prompts and len(out) >= cfg.max_prompts:
            return out
    return out


class PreferenceTask(Task):
    """Prompts from local files, rewards from a local reward model, a penalty for rambling."""

    name = "preference"

    def __init__(self, cfg: TaskConfig, reward_model: RewardModel | None = None):
        self.cfg = cfg
        self._rm = reward_model
        self._splits: dict[str, list[Prompt]] = {}

    @property
    def reward_model(self) -> RewardModel:
        """Loaded on first use, so ranks that never score (learners) never load it."""
        if self._rm is None:
            device, dtype = reward_placement(self.cfg, self.device)
            self._rm = RewardModel(self.cfg.reward_model, batch_size=self.cfg.reward_batch_size,
                                   max_length=self.cfg.reward_max_length,
                                   label=self.cfg.reward_label, device=device, dtype=dtype)
        return self._rm

    def prompts(self, split: str) -> list[Prompt]:
        if split not in self._splits:
            self._splits[split] = self.format_prompts(
                load_prompts(self.cfg, split, answer_field="reference"))
        return self._splits[split]

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> np.ndarray:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return self.reward_model([p.text + r for p, r in zip(prompts, responses)])

    def rewards(self, prompts: Sequence[Prompt], responses: Sequence[str], *,
                finished: Sequence[bool] | None = None) -> tuple[np.ndarray, int]:
        """Task.rewards, minus `unfinished_penalty` for responses whose `finished` is False."""
        rewards, failed = super().rewards(prompts, responses)
        if finished is not None:
            if len(finished) != len(responses):
                raise ValueError(f"{len(finished)} finished flags for {len(responses)} responses")
            rewards = rewards - self.cfg.unfinished_penalty * (~np.asarray(finished, dtype=bool))
        return rewards.astype(np.float32), failed

    def win_rate(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> float:
        """Fraction of prompts whose response outscores the reference response (ties: half)."""
        if any(not p.answer for p in prompts):
            missing = next(p for p in prompts if not p.answer)
            raise DataError(self.cfg.path, f"prompt {missing.id} has no reference response",
                            field="reference")
        ours = self.score(prompts, responses)
        refs = self.score(prompts, [p.answer for p in prompts])
        return float(np.mean((ours > refs) + 0.5 * (ours == refs)))
