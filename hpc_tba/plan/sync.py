"""The planner's weight-sync time: how long one version takes to leave the learners, from the
bytes on the wire and the configured network (cluster.network_gbit_per_s, cluster.nics_per_node).

Today's sync is a star from learner rank 0 (issue 41): with out-of-process engines every engine
has its own feed, and each feed broadcasts the whole version to its engine's workers, so S
engines make S x V bytes leave rank 0's node; in-process engines share one broadcast group, a
pipelined ring that carries V over every link once. Engines run on other nodes than the
learners (hpc_tba.config.topology), so the bytes cross the network. The time is a range: all of it
through one NIC (NCCL runs one GPU's traffic over the NIC nearest to it), down to spread over
every NIC of the node. Not counted: learner rank 0's gathers and its copies into and out of the
held host copies, and the engines' loads, which overlap the transfer bucket by bucket. The smoke
job's verdict prints the measured `sync/time_s` beside this range.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_tba.config import RunConfig
    from hpc_tba.plan.memory import Plan


def sync_seconds(cfg: RunConfig, version_bytes: float) -> tuple[float, float, float]:
    """(bytes leaving learner rank 0's node per version, seconds over all its NICs, over one)."""
    c, s = cfg.cluster, cfg.searcher
    if not c.num_searchers:
        return 0.0, 0.0, 0.0
    out = version_bytes * (c.num_searchers if s.engine_process else 1)
    link = c.network_gbit_per_s * 1e9 / 8
    return out, out / (link * c.nics_per_node), out / link


def sync_rows(plan: Plan, cfg: RunConfig) -> None:
    """The lines of the weight sync's time into `plan`, and plan.sync_s = (fastest, slowest)."""
    c, s = cfg.cluster, cfg.searcher
    version = sum(plan.buckets)
    out, fast, slow = sync_seconds(cfg, version)
    plan.sync_s = (fast, slow)
    how = (f"{c.num_searchers} x {_size(version)}, one broadcast per out-of-process engine"
           if s.engine_process else f"one ring broadcast to {c.num_searchers} searchers")
    plan.lines.append(f"  weight sync, per version ({len(plan.buckets)} bucket(s), {_size(version)} on the wire):")
    plan.lines.append(f"    learner rank 0's node sends {_size(out)} ({how})")
    spread = (f", {fast:.1f} s spread over its {c.nics_per_node}" if c.nics_per_node > 1 else "")
    plan.lines.append(f"    {slow:.1f} s through one {c.network_gbit_per_s:g} Gbit/s NIC{spread} "
                      f"(cluster.network_gbit_per_s, cluster.nics_per_node)")


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"
