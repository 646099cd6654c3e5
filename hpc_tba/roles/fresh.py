"""The reward of freshly generated samples, per policy version (`reward/fresh_by_version`).

What the searchers generate with version v is the policy's own behaviour at v; the reward of
the samples the learner trains on is not (the buffer's sampler and duplicate rule choose them,
buffer/), so a run's report needs both. The learner counts every trajectory it receives under
the version that generated it (`TrajectoryBatch.policy_version`, the oldest token's version),
and once that version is old enough that its samples have (almost) all arrived, logs their mean
reward over every learner rank at step v.
"""
from __future__ import annotations

import math

import numpy as np

from hpc_tba.comm.messages import TrajectoryBatch

CLOSE_SYNCS = 2
"""Syncs after version v at which v is logged: by then the searchers have moved on to later
weights; later arrivals count in `samples/fresh_late` (the run's end logs every open version)."""
PREFIX = "fresh/"


class FreshRewards:
    """Per-version reward sums and counts of the trajectories this learner rank received."""

    def __init__(self) -> None:
        self.acc: dict[int, list[float]] = {}  # version -> [reward sum, responses]
        self.next = 0  # versions below it were logged
        self.late = 0  # responses that arrived after their version was logged

    def add(self, batch: TrajectoryBatch) -> None:
        v = int(batch.policy_version)
        if v < self.next:
            self.late += batch.num_responses
            return
        acc = self.acc.setdefault(v, [0.0, 0])
        acc[0] += float(np.sum(batch.rewards, dtype=np.float64))
        acc[1] += batch.num_responses

    def closing(self, version: int, sync_every: int, *, final: bool = False) -> dict[str, float]:
        """This rank's `fresh/<v>/sum` and `fresh/<v>/n` (NaN where it has none) of the versions
        that close now: CLOSE_SYNCS syncs behind `version` (the latest synced), or all at the end.

        The versions closing depend on the learner's version alone, so every learner rank builds
        the same keys (comm.metrics) and they can be summed with the step's other metrics."""
        end = version + 1 if final else version - CLOSE_SYNCS * sync_every + 1
        out = {}
        for v in range(self.next, end):
            total, n = self.acc.pop(v, (0.0, 0))
            out[f"{PREFIX}{v}/sum"], out[f"{PREFIX}{v}/n"] = (total, float(n)) if n else (math.nan, math.nan)
        self.next = max(self.next, end)
        return out

    @staticmethod
    def split(reduced: dict[str, float]) -> tuple[dict[int, dict[str, float]], dict[str, float]]:
        """({v: {reward/fresh_by_version, samples/fresh_by_version}}, the other metrics) of a
        metrics dict whose `fresh/` keys were summed over the learner ranks."""
        rest = {k: x for k, x in reduced.items() if not k.startswith(PREFIX)}
        by_version = {}
        for key, n in reduced.items():
            if key.startswith(PREFIX) and key.endswith("/n") and n > 0:
                v = int(key[len(PREFIX):].split("/")[0])
                by_version[v] = {"reward/fresh_by_version": reduced[f"{PREFIX}{v}/sum"] / n,
                                 "samples/fresh_by_version": n}
        return dict(sorted(by_version.items())), rest
