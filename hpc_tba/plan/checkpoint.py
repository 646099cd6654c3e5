"""The planner's checkpoint rows: a save's size, its footprint and time, and the USR1 grace check.

What DeepSpeed's ZeRO-3 save writes (CHECKPOINT_BYTES_PER_PARAM x P over all learner ranks),
x (keep_last + 1) on the shared filesystem while a new one is written, and its time at
`cluster.checkpoint_gb_per_s`. A Slurm run is refused when USR1's grace (`cluster.signal_grace_s`)
cannot hold one save plus GRACE_MARGIN: by `hpc-tba plan`, and before anything is queued by the
sbatch generator and submitit's `launch` (`planner.check_grace`). Not at compose time: every rank
composes the config at start, and the check needs the model's shape (its config.json), which a
run started by hand inside an allocation has already paid for.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_tba.plan.memory import ModelSpec, Plan

if TYPE_CHECKING:
    from hpc_tba.config import RunConfig

CHECKPOINT_BYTES_PER_PARAM = 12
"""Bytes per parameter DeepSpeed 0.19's ZeRO-3 `save_checkpoint` writes over all ranks: the fp32
master partition and Adam's m and v, in fp32 and bf16 runs alike (the bit16 module file holds
placeholders only). Measured: 12.01 B/param on a tiny Llama in both dtypes; a test checks it
against a real save (tests/test_checkpoint_async.py)."""
GRACE_MARGIN = (1.25, 30.0)
"""USR1's grace must hold 1.25 x the save (a shared filesystem's bandwidth varies with other jobs'
load; at 70B the 25% is ~200 s, room for the step in progress when the signal lands) + 30 s (the
searchers' drain, exit and requeue: seconds in the CPU tests, tests/test_resume.py)."""


def checkpoint_cost(cfg: RunConfig, spec: ModelSpec) -> tuple[float, float, float]:
    """(bytes of one checkpoint over all learner ranks, seconds to write it to the shared
    filesystem at cluster.checkpoint_gb_per_s, seconds of USR1 grace it needs)."""
    nbytes = CHECKPOINT_BYTES_PER_PARAM * spec.params
    save_s = nbytes / (cfg.cluster.checkpoint_gb_per_s * 1e9)
    return nbytes, save_s, GRACE_MARGIN[0] * save_s + GRACE_MARGIN[1]


def grace_refusal(cfg: RunConfig, spec: ModelSpec) -> str | None:
    """Why USR1's grace cannot hold the final checkpoint (a Slurm run), or None."""
    c = cfg.cluster
    nbytes, save_s, need = checkpoint_cost(cfg, spec)
    if c.backend != "slurm" or c.signal_grace_s >= need:
        return None
    return (f"cluster.signal_grace_s={c.signal_grace_s} is shorter than the checkpoint save: "
            f"{nbytes / 1e9:.3g} GB at {c.checkpoint_gb_per_s:g} GB/s (cluster.checkpoint_gb_per_s) "
            f"take {save_s:.0f} s, and USR1 needs >= {need:.0f} s ({GRACE_MARGIN[0]:g} x the save + "
            f"{GRACE_MARGIN[1]:.0f} s): raise cluster.signal_grace_s, or the preempted run loses "
            "everything since its last checkpoint")


def checkpoint_rows(plan: Plan, cfg: RunConfig, spec: ModelSpec) -> None:
    """The checkpoint's size, footprint, save time and the USR1 grace it needs."""
    c, lr = cfg.cluster, cfg.learner
    n = max(c.num_learners, 1)
    nbytes, save_s, need = checkpoint_cost(cfg, spec)
    plan.lines.append(f"  checkpoint (ZeRO-3 states, {CHECKPOINT_BYTES_PER_PARAM} B/param: fp32 master "
                      f"+ Adam m, v; learner.keep_last {lr.keep_last}):")
    plan.row(f"one checkpoint, {n} learner ranks", nbytes,
             f"{nbytes / 1e9:.3g} GB, {nbytes / n / 1e9:.3g} GB per rank", key="checkpoint")
    plan.row("shared FS: keep_last + 1 being written",
             nbytes * (lr.keep_last + 1), key="checkpoint_footprint")
    if c.checkpoint_staging_dir:
        per_node = nbytes / n * (min(c.gpus_per_node, n) if c.gpus_per_node else 1)
        plan.row("node-local staging per learner node", per_node,
                 f"cluster.checkpoint_staging_dir={c.checkpoint_staging_dir}")
    plan.lines.append(f"    {'save to the shared filesystem':<44} {save_s:9.0f} s    at "
                      f"{c.checkpoint_gb_per_s:g} GB/s (cluster.checkpoint_gb_per_s)")
    plan.lines.append(f"    {'USR1 grace needed':<44} {need:9.0f} s    {GRACE_MARGIN[0]:g} x save + "
                      f"{GRACE_MARGIN[1]:.0f} s; cluster.signal_grace_s={c.signal_grace_s}")
    interval = lr.checkpoint_interval_s
    if interval:
        plan.lines.append(f"    {'every learner.checkpoint_interval_s':<44} {interval:9.0f} s    "
                          f"the shared copy takes {save_s / interval:.1%} of the wall-clock")
        if interval < save_s:
            plan.warnings.append(f"learner.checkpoint_interval_s={interval:g} is shorter than a save "
                                 f"({save_s:.0f} s): each save waits for the previous one's copy")
    refusal = grace_refusal(cfg, spec)
    if refusal:
        plan.problems.append(refusal)
