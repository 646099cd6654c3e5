"""Per-step metric reduction across learner ranks: the one place metrics cross processes."""
from __future__ import annotations

import torch


def reduce_metrics(metrics: dict[str, float], *, op: str = "mean",
                   sum_prefix: str | tuple[str, ...] | None = None) -> dict[str, float]:
    """All-reduce a dict of floats over the learners' default group (identity without one).

    `op` is mean, sum or min; keys starting with `sum_prefix` (a prefix or a tuple of them) are
    summed whatever `op` is (a loss computed with a global normaliser is this rank's share, a
    sample count is this rank's part of the total). Every rank must pass the same
    keys: missing keys on some ranks would misalign the flat tensor, so they are unioned first
    via sorted order of what this rank has — callers build metrics on identical code paths.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(metrics)
    keys = sorted(metrics)
    vals = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    world = dist.get_world_size()
    if op == "min":
        dist.all_reduce(vals, op=dist.ReduceOp.MIN)
        return dict(zip(keys, vals.tolist()))
    summed = vals.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    out = {}
    for k, v in zip(keys, summed.tolist()):
        is_sum = op == "sum" or (sum_prefix is not None and k.startswith(sum_prefix))
        out[k] = v if is_sum else v / world
    return out
