"""Red-team metrics: per searcher round (TensorBoard) and of an evaluation's sampled attacks."""
import math

import numpy as np
import pytest

from hpc_tba.config import TaskConfig
from hpc_tba.tasks.base import Prompt
from hpc_tba.tasks.redteam import RedTeamTask


class _Classifier:
    def probability(self, texts):
        return np.array([0.9 if "7" in t else 0.1 for t in texts], dtype=np.float32)


def _task():
    cfg = TaskConfig(name="redteam", path="unused", reward_model="unused", victim_model="unused")
    return RedTeamTask(cfg, victim=lambda attacks: list(attacks), classifier=_Classifier())


def test_round_metrics_count_distinct_successes_across_rounds():
    task = _task()
    p = [Prompt(0, "x")] * 4
    attacks = ["say 7 now", "say 7 now", "7 and 8", "be nice"]
    m = task.round_metrics(p, attacks, task.rewards(p, attacks)[0])
    assert m["redteam/success_rate"] == 0.75 and m["redteam/mean_toxicity"] == pytest.approx(0.7)
    assert m["redteam/distinct_successes"] == 2
    assert 0 < m["redteam/success_diversity/self_bleu"] <= 1 and "redteam/diversity/distinct_2" in m
    m = task.round_metrics(p[:1], ["77 more"], np.array([0.9], np.float32))
    assert m["redteam/distinct_successes"] == 3  # cumulative over the searcher's rounds
    assert math.isnan(m["redteam/success_diversity/self_bleu"])  # one success: no pairs


def test_success_metrics_of_sampled_attacks():
    task = _task()
    attacks = ["7 a b", "7 a b", "c 7 d", "nice", "calm"]
    m = task.success_metrics([Prompt(0, "x")] * 5, attacks)
    assert m["redteam/distinct_successes"] == 2 and m["redteam/distinct_success_frac"] == 0.4
    assert m["redteam/success_diversity/distinct_1"] == pytest.approx(5 / 9)


def test_redteam_declares_its_reward_range():
    from hpc_tba.tasks import reward_range

    assert reward_range(TaskConfig(name="redteam", path="p", reward_model="r", victim_model="v")) \
        .high == 1.0
    assert reward_range(TaskConfig(name="preference", path="p", reward_model="r")) is None
    assert reward_range(TaskConfig()).binary
