"""A failing engine never stops the run: the searcher rebuilds it, reloads the current weights and
carries on while the learner keeps stepping (real mpiexec, vLLM, DeepSpeed)."""
import json
import os
import subprocess

from conftest import HPC_TBA

STEPS = 24


def test_engine_failure_and_nan_losses_are_survived(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, HPC_TBA_FAULT_ENGINE_ROUNDS="8", HPC_TBA_FAULT_NAN_STEPS="5,6")
    proc = subprocess.run(
        [HPC_TBA, "train", f"learner.total_steps={STEPS}", "learner.eval_every=0",
         "learner.sync_check=true", "buffer.warm_start=100", "learner.export_final=false",
         f"run_dir={run_dir}"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stderr.count("engine failed (RuntimeError: injected engine fault in round 8)") == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["nonfinite_skipped"] == 2  # NaN losses at steps 5 and 6: skipped, counted
    assert "step 5: non-finite loss, update skipped" in proc.stderr
    for i in (0, 1):
        rows = [json.loads(line) for line in open(run_dir / f"metrics_searcher{i}.jsonl")]
        at = [j for j, r in enumerate(rows) if "searcher/engine_restarts" in r]  # file order = time
        assert len(at) == 1 and rows[at[0]]["searcher/engine_restarts"] == 1
        generated = [(j, r["searcher/version"]) for j, r in enumerate(rows) if "searcher/reward_mean" in r]
        before = [v for j, v in generated if j < at[0]]
        after = [v for j, v in generated if j > at[0]]
        assert after and min(after) >= max(before, default=0)  # generating again, never older
        # the rebuilt engine reloaded the newest weights the searcher had applied before the fault
        applied = [r["searcher/version"] for r in rows[:at[0]] if "searcher/weight_apply_s" in r]
        assert rows[at[0]]["searcher/version"] == max(applied, default=0) >= max(before, default=0)
    gaps = summary["sync_logprob_gap"]
    for by_version in gaps.values():  # every engine, old or rebuilt, matches the learner
        assert max(by_version.values()) < 1e-4 and max(int(v) for v in by_version) == STEPS


def test_a_lost_rank_ends_the_job_step_promptly(tmp_path):
    """A rank killed outright must not leave the others hanging: the job step ends (and
    Slurm's requeue or resume=auto continues it from the last checkpoint, see test_resume)."""
    import signal
    import time

    import psutil

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([HPC_TBA, "train", "learner.total_steps=200", "learner.eval_every=0",
                             "buffer.warm_start=100", f"run_dir={run_dir}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 600
        metrics = run_dir / "metrics_learner.jsonl"
        while not (metrics.exists() and "loss/tb" in metrics.read_text()):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.5)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "hpc_tba.cli.rank" in " ".join(p.cmdline())]
        searcher = max(ranks, key=lambda p: p.pid)
        searcher.send_signal(signal.SIGKILL)
        t0 = time.time()
        proc.wait(timeout=120)
        assert proc.returncode != 0
        assert time.time() - t0 < 60
        assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_nonfinite_losses_are_skipped_then_abort_after_n_in_a_row():
    import types

    import pytest
    import torch

    from hpc_tba.config import LearnerConfig
    from hpc_tba.roles.learner import Learner

    state = types.SimpleNamespace(cfg=LearnerConfig(max_nonfinite_steps=2), step=0,
                                  nonfinite_skipped=0, _nonfinite_in_row=0)
    skip = lambda x: Learner._skip_if_nonfinite(state, torch.tensor(x))  # noqa: E731
    assert skip(1.0) is False
    assert skip(float("nan")) is True and skip(float("inf")) is True
    assert skip(0.5) is False and state._nonfinite_in_row == 0  # a good step resets the run
    assert skip(float("nan")) is True and skip(float("nan")) is True
    with pytest.raises(FloatingPointError, match="NaN/inf for 3 steps in a row"):
        skip(float("nan"))
    assert state.nonfinite_skipped == 5
