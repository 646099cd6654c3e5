"""How the task, the objective and the replay sampler fit together (checked at composition).

`fit_run(cfg)` is called by RunConfig.__post_init__, so every entry point (train, plan, eval,
preprocess, tests composing a config) sees the same resolved values, and the run's saved
config.yaml records them:

- algo.tb_logz=learned is refused (no learner owns a logZ parameter).
- TOPR's reward map: algo.reward_map resolved against the task's declared reward range
  (LossConfig.fit_rewards; an ill-defined positive/negative split is refused).
- algo=alol (advantage-weighted variants) selects buffer.sampler=advantage (A-LoL draws rows
  ∝ A+) when the buffer is left at TBA's sampler.
- task=offline turns off TBA's recency slots (buffer.recency_m=0): no searcher ever refreshes an
  offline prompt, so every prompt would stay "recent" and recency slots would take each prompt's
  last K rows in file order for the whole run. What is left of TBA's sampler is its priority
  slot: uniform at buffer.inv_temp=0, reward priority above (buffer=tldr).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hpc_tba.tasks import reward_range


def fit_run(cfg: Any) -> None:
    """Resolve and check the cross-component settings of a RunConfig in place."""
    if cfg.algo.name == "tb" and cfg.algo.tb_logz == "learned":
        # The loss accepts a logZ tensor, but no learner owns one: a per-prompt logZ table would be
        # a trained, checkpointed parameter sharded by the buffer's prompt routing, outside the
        # ZeRO-3 model (roles/learner.py). Refused at composition rather than at the first step.
        raise ValueError("algo.tb_logz=learned is not supported by the learner (it holds no logZ "
                         "parameter to train); use algo.tb_logz=vargrad, the TBA paper's per-prompt "
                         "batch estimate")
    rng = reward_range(cfg.task)
    cfg.algo = cfg.algo.fit_rewards(None if rng is None else (rng.low, rng.high), task=cfg.task.name)
    if cfg.algo.needs_advantages and cfg.buffer.sampler == "tba":
        cfg.buffer = dataclasses.replace(cfg.buffer, sampler="advantage")
    if cfg.task.name == "offline" and cfg.buffer.sampler == "tba" and cfg.buffer.recency_m > 0:
        cfg.buffer = dataclasses.replace(cfg.buffer, recency_m=0.0)
