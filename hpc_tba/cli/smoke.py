"""The smoke job's two steps around the run (`+experiment=tba_8b_smoke`, slurm/tba_8b_smoke.sh).

    python -m hpc_tba.cli.smoke preempt RUN_DIR STEP     # in the background, first start only
    python -m hpc_tba.cli.smoke verdict RUN_DIR <overrides>

`preempt` waits until the learner has logged STEP in RUN_DIR/metrics_learner.jsonl, then sends
USR1 to every task of the job's steps (`scancel --signal=USR1 $SLURM_JOB_ID`): what Slurm's
`--signal=USR1@grace` sends before a time limit, so the run takes its real preemption path (every
role checkpoints at the next step boundary, rank 0 calls `scontrol requeue`, the same job id
starts again and resumes from that checkpoint).

`verdict` reads what the finished run left and prints one line, PASS or FAIL, with the figures a
user compares with `hpc-tba plan` before the big job: the weight sync's time per version (the
learner's send, beside the plan's range from hpc_tba.plan.sync, and out-of-process engines'
receive), the step time after the resume, and the memory per learner GPU next to the plan's
figure: torch's peak reserved bytes (`memory/peak_gib`) and the most the device had in use at a
logged step (`memory/device_used_gib`, cudaMemGetInfo: with NCCL's buffers, which torch does not
see, and the CUDA context), each the max over learner ranks. PASS needs all of: every step
trained, the job requeued exactly once, one resume from a checkpoint at or after the preemption
step, the steps after it continuing from it (not restarted), and a complete checkpoint at the
last step. Exit status 0 on PASS, 1 on FAIL.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

METRICS = "metrics_learner.jsonl"


def learner_rows(run_dir: str | os.PathLike) -> list[dict]:
    """The learner's logged rows, oldest first (a line cut off by a kill is skipped)."""
    from hpc_tba.checkpoint.runfiles import read_jsonl

    return read_jsonl(Path(run_dir) / METRICS)


def preempt(run_dir: str, step: int, *, job_id: str | None = None, poll_s: float = 0.5,
            scancel: str = "scancel") -> int:
    """Wait for the learner's `step`, then USR1 to the job's tasks; returns scancel's status."""
    job_id = job_id or os.environ["SLURM_JOB_ID"]
    while not any(r.get("step", 0) >= step for r in learner_rows(run_dir)):
        time.sleep(poll_s)
    print(f"smoke: learner step {step} logged; preempting job {job_id} (USR1 to every rank)",
          flush=True)
    return subprocess.run([scancel, "--signal=USR1", job_id]).returncode


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def figures(rows: list[dict]) -> dict[str, float | None]:
    """Sync time per version (learner send, engines' receive), step time and peak memory, from
    the rows after the resume, if any (the timers restart with the process)."""
    at = next((i for i, r in enumerate(rows) if "checkpoint/resumed_step" in r), -1)
    after = rows[at + 1:]
    timed = [r for r in after if "time/elapsed_s" in r]
    step_s = None
    if len(timed) >= 2:
        first, last = timed[0], timed[-1]
        step_s = (last["time/elapsed_s"] - first["time/elapsed_s"]) / max(last["step"] - first["step"], 1)
    peaks = [r["memory/peak_gib"] for r in rows if "memory/peak_gib" in r]
    used = [r["memory/device_used_gib"] for r in rows if "memory/device_used_gib" in r]
    return {"sync_s": _median([r["sync/time_s"] for r in after if "sync/time_s" in r]),
            "engine_sync_s": _median([r["sync/engine_time_s"] for r in after if r.get("sync/engine_time_s")]),
            "step_s": step_s, "peak_gib": max(peaks) if peaks else None,
            "device_used_gib": max(used) if used else None}


def judge(run_dir: str, *, total_steps: int, preempt_step: int, restarts: int,
          checkpoint_step: int | None) -> tuple[list[str], int | None]:
    """(what failed, one line each; the step the run resumed from, if it did)."""
    rows, problems = learner_rows(run_dir), []
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if summary.get("steps") != total_steps or summary.get("preempted"):
        problems.append(f"the run ended at step {summary.get('steps')} of {total_steps}"
                        + (" (preempted)" if summary.get("preempted") else ""))
    if restarts != 1:
        problems.append(f"the job was requeued {restarts} times, not once")
    resumed = [int(r["checkpoint/resumed_step"]) for r in rows if "checkpoint/resumed_step" in r]
    resumed_at = resumed[0] if len(resumed) == 1 else None
    if resumed_at is None:
        problems.append(f"the run resumed {len(resumed)} times from a checkpoint, not once")
    elif not preempt_step <= resumed_at < total_steps:
        problems.append(f"the run resumed at step {resumed_at}, not between the preemption "
                        f"(step {preempt_step}) and the end ({total_steps})")
    else:  # the rows logged after the resume, in their order: the steps that follow it, once each
        at = next(i for i, r in enumerate(rows) if "checkpoint/resumed_step" in r)
        trained = [int(r["step"]) for r in rows[at + 1:] if any(k.startswith("loss/") for k in r)]
        if trained != list(range(resumed_at + 1, total_steps + 1)):
            problems.append(f"after the resume at step {resumed_at} the learner logged steps "
                            f"{trained[:3]}..., not {resumed_at + 1}..{total_steps}")
    if checkpoint_step != total_steps:
        problems.append(f"the newest complete checkpoint is of step {checkpoint_step}, not {total_steps}")
    return problems, resumed_at


def _fmt(v: float | None, unit: str) -> str:
    return "n/a" if v is None else f"{v:.2f} {unit}"


def verdict(run_dir: str, overrides: Sequence[str], *, restarts: int | None = None) -> tuple[bool, str]:
    """(PASS?, the one line) for the finished smoke run in `run_dir` composed from `overrides`."""
    from hpc_tba.assembly.compose import compose
    from hpc_tba.checkpoint.runfiles import latest_checkpoint
    from hpc_tba.plan.planner import PlanOptions, make_plan

    cfg = compose([*overrides, f"run_dir={run_dir}"])
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", 0)) if restarts is None else restarts
    latest = latest_checkpoint(run_dir)
    ckpt_step = None
    if latest:
        with open(os.path.join(latest, "learner.json")) as f:
            ckpt_step = int(json.load(f)["step"])
    problems, resumed_at = judge(run_dir, total_steps=cfg.learner.total_steps,
                                 preempt_step=cfg.cluster.smoke_preempt_step, restarts=restarts,
                                 checkpoint_step=ckpt_step)
    fig = figures(learner_rows(run_dir))
    plan = make_plan(cfg, PlanOptions(deepspeed=False))
    if cfg.cluster.gpus_per_node:
        memory = (f"peak {_fmt(fig['peak_gib'], 'GiB')} per learner GPU in torch's pool, "
                  f"{_fmt(fig['device_used_gib'], 'GiB')} used on the device with NCCL and the CUDA "
                  f"context (plan {plan.learner_gib:.2f} GiB)")
    else:  # CPU stand-ins: the process's peak RSS; the plan's per-GPU rows count no runtime
        memory = f"peak RSS {_fmt(fig['peak_gib'], 'GiB')} per learner rank (CPU: no GPU figure to compare)"
    where = f"requeued once, resumed at step {resumed_at}" if resumed_at is not None else "no resume"
    engines = "" if fig["engine_sync_s"] is None else f", engines receive {fig['engine_sync_s']:.2f} s"
    fast, slow = plan.sync_s
    figures_text = (f"sync {_fmt(fig['sync_s'], 's')} per version (plan {fast:.2f}-{slow:.2f} s{engines}); "
                    f"step {_fmt(fig['step_s'], 's')}; {memory}")
    ok = not problems
    head = f"{cfg.name}: {'PASS' if ok else 'FAIL'}"
    body = (f"{cfg.learner.total_steps} steps, {where}" if ok else "; ".join(problems))
    return ok, f"{head} - {body}; {figures_text}"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 3 and args[0] == "preempt":
        return preempt(args[1], int(args[2]))
    if len(args) >= 2 and args[0] == "verdict":
        ok, line = verdict(args[1], [a for a in args[2:] if not a.startswith("run_dir=")])
        print(line, flush=True)
        return 0 if ok else 1
    print("usage: python -m hpc_tba.cli.smoke {preempt RUN_DIR STEP | verdict RUN_DIR <overrides>}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
