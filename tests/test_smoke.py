"""The smoke job's pieces without Slurm (hpc_tba.cli.smoke): the verdict fails, by name, on
each way a run can go wrong; `preempt` waits for the step and then signals; the preset plans
FITS and its checks refuse a preemption that cannot happen. The whole job runs on the local Slurm
in test_slurm_local.py::test_smoke_job_on_stand_ins_preempts_requeues_resumes_and_passes."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from hpc_tba.assembly.compose import compose
from hpc_tba.cli import smoke
from hpc_tba.plan.planner import PlanOptions, make_plan


def _run(tmp_path, *, steps=20, resumed_at=6, after=None, summary_steps=20, preempted=False):
    """A run directory as the learner leaves it: rows up to the preemption, the resume, then
    `after` (the steps logged after the resume), and summary.json."""
    rows = [{"step": s, "loss/tb": 1.0, "time/elapsed_s": 1.0 * s, "sync/time_s": 0.5,
             "memory/peak_gib": 2.0} for s in range(1, (resumed_at or 0) + 1)]
    if resumed_at is not None:
        rows.append({"step": resumed_at, "checkpoint/resumed_step": resumed_at})
    after = range((resumed_at or 0) + 1, steps + 1) if after is None else after
    rows += [{"step": s, "loss/tb": 1.0, "time/elapsed_s": 2.0 * (s - (resumed_at or 0)),
              "sync/time_s": 0.25, "sync/engine_time_s": 0.75, "memory/peak_gib": 3.0,
              "memory/device_used_gib": 3.5 + 0.01 * s} for s in after]
    (tmp_path / smoke.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2')
    (tmp_path / "summary.json").write_text(json.dumps({"steps": summary_steps, "preempted": preempted}))
    return str(tmp_path)


def test_judge_passes_a_run_that_was_preempted_once_and_resumed(tmp_path):
    run = _run(tmp_path)
    problems, resumed = smoke.judge(run, total_steps=20, preempt_step=5, restarts=1, checkpoint_step=20)
    assert problems == [] and resumed == 6
    fig = smoke.figures(smoke.learner_rows(run))  # the cut-off last line is skipped
    assert fig == {"sync_s": 0.25, "engine_sync_s": 0.75, "step_s": 2.0, "peak_gib": 3.0, "device_used_gib": 3.7}


@pytest.mark.parametrize("kw, run_kw, words", [
    ({"restarts": 0}, {}, "requeued 0 times, not once"),
    ({"restarts": 2}, {}, "requeued 2 times, not once"),
    ({}, {"resumed_at": None, "after": range(1, 21)}, "resumed 0 times from a checkpoint"),
    ({}, {"resumed_at": 3}, "resumed at step 3, not between the preemption (step 5)"),
    ({}, {"after": range(1, 21)}, "after the resume at step 6 the learner logged steps [1, 2, 3]"),
    ({}, {"summary_steps": 12}, "the run ended at step 12 of 20"),
    ({}, {"preempted": True}, "(preempted)"),
    ({"checkpoint_step": 10}, {}, "the newest complete checkpoint is of step 10, not 20"),
])
def test_judge_names_each_way_a_smoke_run_fails(tmp_path, kw, run_kw, words):
    args = {"total_steps": 20, "preempt_step": 5, "restarts": 1, "checkpoint_step": 20} | kw
    problems, _ = smoke.judge(_run(tmp_path, **run_kw), **args)
    assert len(problems) == 1 and words in problems[0], problems


def test_verdict_line_reads_the_checkpoint_and_the_plan(tmp_path):
    run = _run(tmp_path)
    ckpt = tmp_path / "checkpoints" / "step_000020"
    ckpt.mkdir(parents=True)
    (ckpt / "learner.json").write_text(json.dumps({"step": 20}))
    from hpc_tba.checkpoint.runfiles import COMPLETE

    (ckpt / COMPLETE).write_text("")
    (tmp_path / "checkpoints" / "latest").write_text("step_000020")
    ok, line = smoke.verdict(run, ["+experiment=tba_8b_smoke"], restarts=1)
    plan = make_plan(compose(["+experiment=tba_8b_smoke"]), PlanOptions(deepspeed=False))
    assert ok, line
    fast, slow = plan.sync_s
    assert 0 < fast <= slow
    assert line == (f"tba_8b_smoke: PASS - 20 steps, requeued once, resumed at step 6; sync 0.25 s per "
                    f"version (plan {fast:.2f}-{slow:.2f} s, engines receive 0.75 s); step 2.00 s; "
                    f"peak 3.00 GiB per learner GPU in "
                    f"torch's pool, 3.70 GiB used on the device with NCCL and the CUDA context (plan "
                    f"{plan.learner_gib:.2f} GiB)")
    ok, line = smoke.verdict(run, ["+experiment=tba_8b_smoke"], restarts=0)
    assert not ok and line.startswith("tba_8b_smoke: FAIL - the job was requeued 0 times, not once; sync ")


def test_preempt_waits_for_the_step_then_signals_the_job(tmp_path):
    fake = tmp_path / "scancel"
    fake.write_text(f"#!/bin/bash\necho \"$@\" > {tmp_path}/signalled\n")
    fake.chmod(0o755)
    metrics = tmp_path / smoke.METRICS
    metrics.write_text(json.dumps({"step": 4}) + "\n")
    done = []
    t = threading.Thread(target=lambda: done.append(smoke.preempt(
        str(tmp_path), 5, job_id="77", poll_s=0.02, scancel=str(fake))))
    t.start()
    time.sleep(0.3)
    assert not done and not (tmp_path / "signalled").exists()  # step 4 only: still waiting
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": 5}) + "\n")
    t.join(10)
    assert done == [0]
    assert (tmp_path / "signalled").read_text().split() == ["--signal=USR1", "77"]


def test_smoke_preset_plans_fits_and_refuses_a_preemption_that_cannot_happen():
    cfg = compose(["+experiment=tba_8b_smoke"])
    assert (cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.cluster.num_learners) == (2, 8, 8)
    assert (cfg.cluster.num_searchers, cfg.searcher.tensor_parallel_size) == (2, 4)
    assert (cfg.learner.total_steps, cfg.learner.checkpoint_every, cfg.cluster.smoke_preempt_step) == (20, 10, 5)
    plan = make_plan(cfg, PlanOptions(deepspeed=False))
    assert plan.fits, plan.problems
    with pytest.raises(ValueError, match="preemption must come before learner.total_steps=5"):
        compose(["+experiment=tba_8b_smoke", "learner.total_steps=5"])
    with pytest.raises(ValueError, match=r"must resume from it \(resume=auto, got resume=never\)"):
        compose(["+experiment=tba_8b_smoke", "resume=never"])
    with pytest.raises(ValueError, match="needs cluster.backend=slurm and cluster.requeue=true"):
        compose(["+experiment=tba_8b_smoke", "cluster.requeue=false"])
    assert os.access(os.path.join(os.path.dirname(__file__), "..", "slurm", "tba_8b_smoke.sh"), os.X_OK)
