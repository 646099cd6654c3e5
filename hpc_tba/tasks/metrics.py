"""Evaluation metrics for tasks with a verifiable reward: greedy pass@1, unbiased pass@k, maj@k.

Pure functions of (prompts, responses) and a Task: generation happens elsewhere (`hpc-tba eval`
drives the engine), so these are testable with hand-written responses.

- pass@1 (greedy): the fraction of prompts whose single greedy response is correct (TBA's GSM8K
  metric).
- pass@k from n >= k samples per prompt: the unbiased estimator of Chen et al. (2021, "Evaluating
  Large Language Models Trained on Code"), 1 - C(n-c, k) / C(n, k) for c correct of n, computed as a
  product so that n = 200 does not overflow. Averaging it over prompts is unbiased; taking the
  first k samples would not be.
- maj@k: the most frequent final answer among the first k samples (ties: the one seen first),
  correct if a response stating it is correct. Answers are grouped by the task's
  `canonical_answer(response)` when it has one (math tasks: exact rationals, so `0.5` and `1/2`
  vote together), else by the stripped response text. Responses with no answer do not vote.

A response whose scoring raises counts as incorrect and is reported in `eval/failed` (Task.rewards).
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from hpc_tba.tasks.base import Prompt, Task


@runtime_checkable
class HasCanonicalAnswer(Protocol):
    def canonical_answer(self, response: str) -> str | None: ...


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with c correct out of n samples: 1 - C(n-c,k)/C(n,k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # C(n-c,k)/C(n,k) = prod_{i=n-c+1}^{n} (1 - k/i): stable for large n.
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def _check(prompts: Sequence[Prompt], samples: Sequence[Sequence[str]], k: int) -> None:
    if len(prompts) != len(samples):
        raise ValueError(f"{len(prompts)} prompts but {len(samples)} lists of responses")
    if not prompts:
        raise ValueError("nothing to evaluate: no prompts")
    short = [i for i, s in enumerate(samples) if len(s) < k]
    if short:
        raise ValueError(f"k={k} but prompt {prompts[short[0]].id} has only "
                         f"{len(samples[short[0]])} responses")


def correctness(task: Task, prompts: Sequence[Prompt],
                samples: Sequence[Sequence[str]]) -> tuple[list[np.ndarray], int]:
    """Per prompt, a bool array over its responses; and the number of samples whose scoring failed.

    Scores everything in one batched call (reward models and verifiers like large batches).
    """
    flat_p = [p for p, s in zip(prompts, samples) for _ in s]
    flat_r = [r for s in samples for r in s]
    rewards, failed = task.rewards(flat_p, flat_r) if flat_r else (np.zeros(0), 0)
    ok = rewards > 0.5
    bounds = np.cumsum([0] + [len(s) for s in samples])
    return [ok[a:b] for a, b in itertools.pairwise(bounds)], failed


def greedy_pass_at_1(task: Task, prompts: Sequence[Prompt], responses: Sequence[str]) -> float:
    """Fraction of prompts whose (greedy) response is correct."""
    _check(prompts, [[r] for r in responses], 1)
    ok, _ = correctness(task, prompts, [[r] for r in responses])
    return float(np.mean([o[0] for o in ok]))


def mean_pass_at_k(task: Task, prompts: Sequence[Prompt], samples: Sequence[Sequence[str]],
                   k: int) -> float:
    """Unbiased pass@k averaged over prompts (each prompt may have a different n >= k)."""
    _check(prompts, samples, k)
    ok, _ = correctness(task, prompts, samples)
    return float(np.mean([pass_at_k(len(o), int(o.sum()), k) for o in ok]))


def majority_answer(responses: Sequence[str],
                    answer_fn: Callable[[str], str | None]) -> tuple[str | None, int]:
    """(most frequent answer, index of the first response giving it); (None, -1) if none answers."""
    answers = [answer_fn(r) for r in responses]
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None, -1
    best = max(counts.values())
    # Ties go to the answer seen first, so the result does not depend on hashing order.
    winner = next(a for a in answers if a is not None and counts[a] == best)
    return winner, answers.index(winner)


def maj_at_k(task: Task, prompts: Sequence[Prompt], samples: Sequence[Sequence[str]], k: int,
             answer_fn: Callable[[str], str | None] | None = None) -> float:
    """Fraction of prompts whose majority answer over the first k samples is correct."""
    _check(prompts, samples, k)
    fn = answer_fn or _default_answer_fn(task)
    chosen_p, chosen_r = [], []
    for p, s in zip(prompts, samples):
        _, idx = majority_answer(s[:k], fn)
        if idx >= 0:
            chosen_p.append(p)
            chosen_r.append(s[idx])
    if not chosen_r:
        return 0.0
    correct = task.rewards(chosen_p, chosen_r)[0] > 0.5
    return float(correct.sum()) / len(prompts)


def _default_answer_fn(task: Task) -> Callable[[str], str | None]:
    if isinstance(task, HasCanonicalAnswer):
        return task.canonical_answer
    return lambda r: r.strip() or None


def evaluate_samples(task: Task, prompts: Sequence[Prompt], samples: Sequence[Sequence[str]],
                     ks: Sequence[int] = (1,), *, greedy: Sequence[str] | None = None
                     ) -> dict[str, float]:
    """All metrics for one evaluation, namespaced for TensorBoard/JSON.

    `samples[i]` are the sampled responses to `prompts[i]` (pass@k and maj@k for every k in `ks`
    that every prompt has enough samples for); `greedy[i]`, if given, its greedy response
    (`eval/pass@1_greedy`). Also reports `eval/num_prompts`, `eval/accuracy` (fraction of all
    samples correct) and `eval/failed` (samples whose scoring raised).
    """
    _check(prompts, samples, 1)
    ok, failed = correctness(task, prompts, samples)
    n_min = min(len(s) for s in samples)
    out: dict[str, float] = {"eval/num_prompts": float(len(prompts)),
                             "eval/accuracy": float(np.mean(np.concatenate(ok)))}
    fn = _default_answer_fn(task)
    for k in ks:
        if k > n_min:
            continue
        out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(len(o), int(o.sum()), k) for o in ok]))
        out[f"eval/maj@{k}"] = maj_at_k(task, prompts, samples, k, fn)
    if greedy is not None:
        _check(prompts, [[g] for g in greedy], 1)
        ok_g, failed_g = correctness(task, prompts, [[g] for g in greedy])
        out["eval/pass@1_greedy"] = float(np.mean([o[0] for o in ok_g]))
        failed += failed_g
    out["eval/failed"] = float(failed)
    return out
