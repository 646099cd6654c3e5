"""The final summary a user reads at the end of a run."""
from __future__ import annotations


def print_summary(s: dict) -> None:
    before, after = s.get("pass@1_before"), s.get("pass@1_after")
    fmt = (lambda x: "n/a" if x is None else f"{100 * x:.1f}%")
    received = sum(s.get("trajectories_received", {}).values())
    lines = [
        "",
        "=== hpc_tba run summary ===",
        f"learner steps        {s['steps']} (final policy version {s['final_version']})",
        f"trajectories in      {received} prompt groups, buffer holds {s['buffer_size']} responses",
        f"held-out pass@1      before {fmt(before)}  ->  after {fmt(after)}",
    ]
    if before is not None and after is not None:
        lines.append(f"change               {100 * (after - before):+.1f} points")
    print("\n".join(lines), flush=True)
