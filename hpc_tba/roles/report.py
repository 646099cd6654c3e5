"""The final summary a user reads at the end of a run (printed once, by learner rank 0)."""
from __future__ import annotations

import os


def summary_lines(s: dict, *, run_dir: str | None = None, report: str | None = None) -> list[str]:
    before, after = s.get("pass@1_before"), s.get("pass@1_after")
    fmt = (lambda x: "n/a" if x is None else f"{100 * x:.1f}%")
    # run totals over every learner's shard (older summaries: learner 0's shard only)
    received = s.get("trajectories_received_total", sum(s.get("trajectories_received", {}).values()))
    buffered = s.get("buffer_size_total", s["buffer_size"])
    lines = [
        "",
        "=== hpc_tba run summary ===",
        f"learner steps        {s['steps']} (final policy version {s['final_version']})"
        + (" - preempted, checkpointed" if s.get("preempted") else ""),
        f"trajectories in      {received} prompt groups, buffer holds {buffered} responses",
        f"held-out pass@1      before {fmt(before)}  ->  after {fmt(after)}",
    ]
    if before is not None and after is not None:
        lines.append(f"change               {100 * (after - before):+.1f} points")
    elapsed = s.get("time", {}).get("time/elapsed_s")
    if elapsed is not None:
        lines.append(f"wall clock           {elapsed:.0f} s of training (after the roles were built)")
    if run_dir is not None:
        lines.append(f"logs                 {os.path.join(run_dir, 'logs')}/rank<N>.log")
    if report is not None:
        lines.append(f"report               {report}")
    return lines


def print_summary(s: dict, *, run_dir: str | None = None, report: str | None = None) -> None:
    from hpc_tba.launcher.console import say

    say("\n".join(summary_lines(s, run_dir=run_dir, report=report)), stream="out")
