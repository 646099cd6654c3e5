"""pass@1, unbiased pass@k and maj@k on hand-written responses with hand-computed values."""
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from hpc_tba.config import TaskConfig
from hpc_tba.tasks.base import Prompt, Task
from hpc_tba.tasks.math import GSM8KTask
from hpc_tba.tasks.metrics import (
    evaluate_samples,
    greedy_pass_at_1,
    maj_at_k,
    majority_answer,
    mean_pass_at_k,
    pass_at_k,
)


class ExactTask(Task):
    """Reward 1 iff the stripped response equals the answer; raises on 'boom' (a broken scorer)."""

    def prompts(self, split: str) -> list[Prompt]:
        return [Prompt(0, "a", "1"), Prompt(1, "b", "2")]

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> np.ndarray:
        if any("boom" in r for r in responses):
            raise RuntimeError("scorer crashed")
        return np.array([float(r.strip() == p.answer) for p, r in zip(prompts, responses)])


def test_pass_at_k_hand_computed() -> None:
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k wrong samples: every k-subset has a right one
    exact = 1 - math.comb(200 - 7, 50) / math.comb(200, 50)
    assert pass_at_k(200, 7, 50) == pytest.approx(exact, rel=1e-12)
    for bad in ((5, 6, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_is_the_mean_over_k_subsets() -> None:
    """Unbiasedness made concrete: it equals the fraction of k-subsets holding a correct sample."""
    outcomes = [1, 0, 0, 1, 0, 0]
    for k in range(1, 7):
        subsets = list(itertools.combinations(outcomes, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(6, sum(outcomes), k) == pytest.approx(brute)


def test_greedy_and_mean_pass_at_k() -> None:
    task = ExactTask()
    p = task.prompts("test")
    assert greedy_pass_at_1(task, p, ["1", "3"]) == 0.5
    samples = [["1", "0", "0", "0"], ["0", "0", "2", "2"]]
    # prompt 0: 1 of 4 -> pass@2 = 1 - C(3,2)/C(4,2) = 0.5; prompt 1: 2 of 4 -> 1 - 1/6
    assert mean_pass_at_k(task, p, samples, 2) == pytest.approx((0.5 + 5 / 6) / 2)
    with pytest.raises(ValueError, match="k=5 but prompt 0 has only 4 responses"):
        mean_pass_at_k(task, p, samples, 5)
    with pytest.raises(ValueError, match="2 prompts but 1 lists"):
        mean_pass_at_k(task, p, samples[:1], 1)


def test_majority_answer_ties_and_abstentions() -> None:
    ident = lambda r: r or None
    assert majority_answer(["3", "5", "5"], ident) == ("5", 1)
    assert majority_answer(["3", "5"], ident) == ("3", 0)  # tie: first seen
    assert majority_answer(["", "", "7"], ident) == ("7", 2)  # no answer does not vote
    assert majority_answer(["", ""], ident) == (None, -1)


def test_maj_at_k_uses_first_k_and_canonical_answers(tmp_path: Path) -> None:
    task = ExactTask()
    p = task.prompts("test")
    samples = [["1", "0", "1", "0", "0"], ["2", "3", "3", "2", "2"]]
    assert maj_at_k(task, p, samples, 3) == 0.5  # first 3: "1" wins, "3" wins
    assert maj_at_k(task, p, samples, 5) == 0.5  # all 5: "0" wins, "2" wins
    assert maj_at_k(task, p, samples, 1) == 1.0  # first samples "1" and "2": both right

    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 0.5"}) + "\n")
    gsm = GSM8KTask(TaskConfig(name="gsm8k", path=str(tmp_path)))
    q = gsm.prompts("test")
    votes = [["#### 0.7", "#### 0.5", "so it is 1/2"]]
    assert maj_at_k(gsm, q, votes, 3) == 1.0  # 0.5 and 1/2 are one answer with 2 votes
    assert maj_at_k(gsm, q, votes, 3, answer_fn=str.strip) == 0.0  # as strings: 3-way tie -> 0.7


def test_evaluate_samples_and_failed_scoring() -> None:
    task = ExactTask()
    p = task.prompts("test")
    samples = [["1", "boom", "0"], ["2", "2", "x"]]
    out = evaluate_samples(task, p, samples, ks=(1, 2, 4), greedy=["1", "boom"])
    assert out["eval/num_prompts"] == 2.0
    assert out["eval/accuracy"] == pytest.approx(3 / 6)
    assert out["eval/pass@1"] == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert out["eval/pass@2"] == pytest.approx(((1 - 1 / 3) + 1.0) / 2)
    assert "eval/pass@4" not in out  # only 3 samples per prompt
    assert out["eval/maj@2"] == 1.0  # tie "1"/"boom" -> "1" (first seen), right; "2" right
    assert out["eval/maj@1"] == 1.0
    assert out["eval/pass@1_greedy"] == 0.5
    assert out["eval/failed"] == 2.0  # one crashed sample, one crashed greedy response
