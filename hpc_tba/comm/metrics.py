"""Per-step metric reduction across learner ranks: the one place metrics cross processes.

Every rank builds the same key set on the same code path; a value a rank does not have this
step (no fresh samples in its shard, no row made by the current weights) is NaN, not absent.
The values travel as ONE float64 tensor on the learners' device (NCCL moves only accelerator
tensors) together with their non-NaN count, so a mean is over the ranks that had the value.
A fingerprint of the key set travels with them: ranks with different keys fail with a clear
error instead of reducing misaligned values.
"""
from __future__ import annotations

import math
import zlib

import torch

OPS = ("mean", "sum", "min", "max")


def default_device() -> torch.device:
    """The device collectives of the default group need: the current CUDA device under NCCL."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fingerprint(keys: list[str]) -> float:
    # < 2**20, so world * fp² stays an exact float64 integer
    return float(zlib.crc32("\0".join(keys).encode()) % (1 << 20))


def reduce_metrics(metrics: dict[str, float], *, op: str = "mean",
                   sum_prefix: str | tuple[str, ...] | None = None,
                   device: torch.device | str | None = None) -> dict[str, float]:
    """All-reduce a dict of floats over the learners' default group (identity without one).

    `op` is mean, sum, min or max, over the ranks whose value is not NaN; keys starting with
    `sum_prefix` (a prefix or a tuple of them) are summed whatever `op` is (a loss computed
    with a global normaliser is this rank's share, a sample count is this rank's part of the
    total). A key NaN on every rank is left out of the result. Every rank must pass the same
    keys (values may be NaN); `device` is the learners' device (default: from the backend).
    """
    import torch.distributed as dist

    if op not in OPS:
        raise ValueError(f"reduce_metrics: op={op!r} is not one of {OPS}")
    keys = sorted(metrics)
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: float(metrics[k]) for k in keys if not math.isnan(float(metrics[k]))}
    dev = torch.device(device) if device is not None else default_device()
    vals = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=dev)
    fp = _fingerprint(keys)
    present = ~torch.isnan(vals)
    # One tensor: [values, NaN as 0 | non-NaN counts | fingerprint, fingerprint²]. The key sets
    # agree iff Σ fp = world·fp and Σ fp² = world·fp² (zero variance), exact in float64.
    packed = torch.cat([torch.where(present, vals, 0.0), present.double(), vals.new_tensor([fp, fp * fp])])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    world = dist.get_world_size()
    if packed[-2].item() != world * fp or packed[-1].item() != world * fp * fp:
        raise RuntimeError(f"reduce_metrics: learner ranks passed different metric keys (this rank: "
                           f"{keys}); every rank must build the same keys, NaN for missing values")
    n = len(keys)
    sums, counts = packed[:n].tolist(), packed[n: 2 * n].tolist()
    if op in ("min", "max"):
        fill = math.inf if op == "min" else -math.inf
        ext = torch.where(present, vals, fill)
        dist.all_reduce(ext, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
        extremes = ext.tolist()
    out = {}
    for i, k in enumerate(keys):
        if counts[i] == 0:
            continue
        if sum_prefix is not None and k.startswith(sum_prefix) or op == "sum":
            out[k] = sums[i]
        elif op == "mean":
            out[k] = sums[i] / counts[i]
        else:
            out[k] = extremes[i]
    return out
