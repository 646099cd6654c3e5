"""Training objectives as pure functions of tensors.

Every objective takes per-token log-probs `[B, T]` of the response tokens, a bool `mask [B, T]`,
per-sample tensors `[B]` and scalar hyper-parameters, and returns `(loss, metrics)`: a scalar
loss (Σ per-sample loss / normalizer) and a dict of detached tensors. No collectives, no
`.item()`, no config objects inside (conventions in `common.py`).

Which objective a run trains with is its `algo` config, a subclass of AlgoConfig declared by the
objective's module and registered in `registry` (its needs: reference model, advantages,
behaviour log-probs, group coupling, loss units); `registry.make_config(name, **fields)` builds
one. The learner calls `compute_loss(cfg, LossInputs(...), step=..., normalizer=...)`. With data
parallelism and/or gradient accumulation it passes as `normalizer` the number of loss units in the
whole optimizer step, `N = Σ_ranks Σ_micro-batches loss_units(cfg, inputs)`, so that SUMMING the
per-rank, per-micro-batch gradients reproduces the single-process full-batch gradient. Engines
that AVERAGE gradients over ranks (DeepSpeed, DDP) need `normalizer = N / world_size` instead.
With an explicit normaliser, `loss/<name>` and `loss/total` are this micro-batch's share: sum them.
Every sample of a prompt group must be in the same micro-batch (TB's logZ, GRPO/RLOO baselines,
DPO pairs).
"""
from __future__ import annotations

import importlib

# Names resolve lazily (PEP 562): `hpc_tba.losses.registry` and the objectives' configs are read
# at composition, which must not pay for importing torch (a bad command line should fail in well
# under a second).
_WHERE = {
    "LossInputs": "dispatch", "compute_loss": "dispatch", "loss_units": "dispatch",
    "group_coupled": "dispatch", "make_config": "registry", "needs": "registry",
    "alol": "alol_loss", "dpo": "baselines", "dpo_pairs": "baselines", "grpo": "baselines",
    "rloo": "baselines", "sft": "baselines", "tb_advantages": "tb", "trajectory_balance": "tb",
    "token_logprobs": "common", "topr": "topr_loss",
}

__all__ = [
    "LossInputs",
    "alol",
    "compute_loss",
    "dpo",
    "dpo_pairs",
    "group_coupled",
    "grpo",
    "loss_units",
    "make_config",
    "needs",
    "rloo",
    "sft",
    "tb_advantages",
    "token_logprobs",
    "topr",
    "trajectory_balance",
]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"hpc_tba.losses.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'hpc_tba.losses' has no attribute {name!r}")
