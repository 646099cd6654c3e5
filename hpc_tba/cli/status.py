"""`hpc-tba status RUN_DIR`: where a run stands, mid-run or after, local or under Slurm.

Reads only the run directory (on the shared filesystem, so it works from a login node):
`status.json`, which learner rank 0 replaces atomically as it logs (roles/logging.RunLogger),
`summary.json` (written at the end), the checkpoints, and the failure records of
hpc_tba.launcher.console. Whether a run is still alive: for a local run on this host, its process; for a
Slurm job, `squeue` when it is on the PATH, else how long ago the status was last written.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time

from hpc_tba.checkpoint.runfiles import latest_checkpoint, read_json

STALE_S = 600.0
"""A status not updated for this long, with no other way to tell, is reported as silent."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process with that id: alive
        return True
    return True


def _slurm_state(job_id: str) -> str | None:
    """The job's state from squeue (RUNNING, PENDING, ...), '' when squeue no longer knows it,
    None when there is no squeue to ask."""
    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def run_status(run_dir: str) -> dict:
    """Everything `hpc-tba status` shows, as a dict (state: running, finished, preempted,
    failed, stopped, silent, starting)."""
    from hpc_tba.launcher.console import failures

    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir} is not a run directory")
    st = read_json(os.path.join(run_dir, "status.json")) or {}
    summary_path = os.path.join(run_dir, "summary.json")
    summary = read_json(summary_path)
    out = dict(st)
    out["run_dir"] = os.path.abspath(run_dir)
    out["checkpoint"] = latest_checkpoint(run_dir)
    out["failures"] = failures(run_dir)
    fresh_summary = summary is not None and os.path.getmtime(summary_path) >= st.get("started_at", 0.0)
    if out["failures"] and out["failures"][0].get("time", 0.0) >= st.get("started_at", 0.0):
        out["state"] = "failed"
    elif fresh_summary:
        out["state"] = "preempted" if summary.get("preempted") else "finished"
        out["step"] = summary.get("steps", out.get("step"))
        out["policy_version"] = summary.get("final_version", out.get("policy_version"))
        out["buffer_size"] = summary.get("buffer_size_total", summary.get("buffer_size", out.get("buffer_size")))
        out["pass@1_first"] = _pass(summary, "pass@1_before", 0) or out.get("pass@1_first")
        out["pass@1"] = _pass(summary, "pass@1_after", summary.get("final_version")) or out.get("pass@1")
    elif not st:
        out["state"] = "starting" if os.path.isfile(os.path.join(run_dir, "config.yaml")) else "unknown"
    elif st.get("state") == "running":
        out["state"] = _alive(st)
    return out


def _pass(summary: dict, key: str, version) -> dict | None:
    return None if summary.get(key) is None else {"version": version, "value": summary[key]}


def _alive(st: dict) -> str:
    age = time.time() - st.get("updated_at", 0.0)
    if st.get("slurm_job_id"):
        state = _slurm_state(st["slurm_job_id"])
        if state is not None:
            return "running" if state in ("RUNNING", "COMPLETING") else (state.lower() or "stopped")
    elif st.get("host") == socket.gethostname() and st.get("pid"):
        return "running" if _pid_alive(int(st["pid"])) else "stopped"
    return "running" if age < STALE_S else "silent"


def format_status(s: dict) -> str:
    pct = (lambda p: "n/a" if not p else f"{100 * p['value']:.1f}% (version {p['version']})")
    where = "local"
    if s.get("slurm_job_id"):
        where = f"Slurm job {s['slurm_job_id']}, restart {s.get('slurm_restart_count', 0)}"
    elif s.get("host"):
        where = f"local, {s['host']} pid {s.get('pid')}"
    total = s.get("total_steps")
    lines = [f"run        {s['run_dir']}",
             f"state      {s['state']} ({where})"]
    if s.get("updated_at"):
        lines[-1] += f", updated {time.time() - s['updated_at']:.0f} s ago"
    lines += [
        f"step       {s.get('step', 0)}" + (f" of {total}" if total else ""),
        f"policy     version {_num(s.get('policy_version'))}",
        f"buffer     {_num(s.get('buffer_size'))} responses; staleness of trained samples mean "
        f"{_num(s.get('staleness_mean'), '.2f')}, max {_num(s.get('staleness_max'))}",
        f"checkpoint {s.get('checkpoint') or 'none yet'}",
        f"pass@1     held-out {pct(s.get('pass@1'))}; at the start {pct(s.get('pass@1_first'))}",
    ]
    if s.get("failures"):
        from hpc_tba.launcher.console import failure_line

        lines.append(failure_line(s["failures"]).replace("hpc-tba: ", "failure    ", 1))
    return "\n".join(lines)


def _num(x, fmt: str = ".0f") -> str:
    return "n/a" if x is None else format(x, fmt)


def status_main(argv: list[str]) -> int:
    """`hpc-tba status RUN_DIR [--json]`."""
    args = [a for a in argv if a != "--json"]
    if len(args) != 1:
        raise SystemExit("usage: hpc-tba status RUN_DIR [--json]")
    s = run_status(args[0])
    print(json.dumps(s, indent=1, default=str) if "--json" in argv else format_status(s))
    return 0
