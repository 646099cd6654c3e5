"""status.json kept by the learner's logger, `hpc-tba status` and report.png, on logged data.

(The same on a real run, mid-run and after: tests/test_first_hour.py.)
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from hpc_tba.cli import status
from hpc_tba.roles.logging import RunLogger, Timers


def _log_run(run_dir, *, steps=6, close=True, summary=True, offset=0.0):
    """A learner and a searcher logging what the real roles log, as they log it."""
    learner = RunLogger(str(run_dir), "learner", total=steps)
    searcher = RunLogger(str(run_dir), "searcher0")
    timers = Timers()
    learner.scalars(0, {"test/pass@1": 0.40 + offset, "test/at_time_s": 0.0})
    for step in range(1, steps + 1):
        with timers("train"):
            pass
        learner.scalars(step, {"loss/total": 1.0 / step, "reward/sampled_mean": 0.4 + 0.05 * step,
                               "buffer/size": 200.0 + step, "buffer/staleness_mean": 1.5,
                               "buffer/staleness_max": 3.0, **timers.metrics(),
                               **({"sync/version": float(step)} if step % 2 == 0 else {})})
        learner.histogram(step, "buffer/staleness", np.array([0, 1, 1, 2, 3]))
        if step % 2 == 0 and step >= 4:  # a version's fresh-sample reward, two syncs later
            learner.scalars(step - 4, {"reward/fresh_by_version": 0.3 + 0.05 * step, "samples/fresh_by_version": 20.0})
        searcher.scalars(step, {"searcher/reward_mean": 0.5, "util/generate": 0.9, "util/apply": 0.05,
                                "util/other": 0.05, "time/elapsed_s": float(step)})
    learner.scalars(steps, {"checkpoint/time_s": 0.1})
    learner.scalars(steps, {"test/pass@1": 0.70 + offset, "test/at_time_s": 5.0})
    if summary:
        learner.write_json("summary.json", {"steps": steps, "final_version": steps, "buffer_size": 206,
                                            "preempted": False, "pass@1_before": 0.40 + offset,
                                            "pass@1_after": 0.70 + offset, "time": timers.metrics()})
    if close:
        learner.close()
        searcher.close()
    return learner, searcher


def test_status_json_follows_the_learner_scalars(tmp_path):
    learner, searcher = _log_run(tmp_path, close=False, summary=False)
    learner._write_status(force=True)
    st = json.loads((tmp_path / "status.json").read_text())
    assert st["state"] == "running" and st["step"] == 6 and st["total_steps"] == 6
    assert st["policy_version"] == 6 and st["buffer_size"] == 206 and st["staleness_max"] == 3
    assert st["pass@1"] == {"version": 6, "value": 0.70} and st["pass@1_first"]["value"] == 0.40
    assert st["last_checkpoint_step"] == 6 and st["pid"] == os.getpid()
    s = status.run_status(str(tmp_path))
    assert s["state"] == "running"  # this process, on this host, is alive
    text = status.format_status(s)
    assert "step       6 of 6" in text and "70.0% (version 6)" in text and "local" in text
    learner.close()
    searcher.close()
    assert status.run_status(str(tmp_path))["state"] == "stopped"  # closed without a summary


def test_status_after_a_finished_run_and_under_slurm(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    _log_run(tmp_path)
    s = status.run_status(str(tmp_path))
    assert s["state"] == "finished" and s["slurm_job_id"] == "4242" and s["slurm_restart_count"] == 2
    assert "Slurm job 4242, restart 2" in status.format_status(s)
    assert json.loads((tmp_path / "histograms_learner.json").read_text()) == {
        "buffer/staleness": {"0": 6, "1": 12, "2": 6, "3": 6}}


def test_status_cli_on_a_run_dir_and_on_a_missing_one(tmp_path):
    _log_run(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": REPO}
    cli = [sys.executable, "-m", "hpc_tba.cli.main", "status"]
    out = subprocess.run([*cli, str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "state      finished" in out.stdout, out.stderr
    bad = subprocess.run([*cli, str(tmp_path / "nope")], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == f"hpc-tba: {tmp_path / 'nope'} is not a run directory"


def test_report_draws_one_run_and_overlays_two(tmp_path):
    from hpc_tba.cli.report import draw_report, load_run

    _log_run(tmp_path / "a")
    _log_run(tmp_path / "b", offset=0.1)
    run = load_run(str(tmp_path / "a"))
    assert run["eval_steps"] == [0, 6] and run["eval_pass"] == [0.40, 0.70]
    assert run["fresh_steps"] == [0, 2] and run["fresh_reward"] == pytest.approx([0.5, 0.6])
    assert run["steps"] == list(range(1, 7))
    assert run["staleness"] == {0: 6, 1: 12, 2: 6, 3: 6} and set(run["util"]) == {"learner", "searcher0"}
    one = draw_report([str(tmp_path / "a")], str(tmp_path / "a" / "report.png"))
    two = draw_report([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "both.png"))
    for png in (one, two):
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 20_000


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path):
    from hpc_tba.cli.report import load_run

    with pytest.raises(FileNotFoundError, match="no metrics_learner.jsonl"):
        load_run(str(tmp_path))


def test_report_cli_redraws_one_run_and_overlays_several(tmp_path):
    _log_run(tmp_path / "sync")
    _log_run(tmp_path / "async", offset=0.1)
    env = {**os.environ, "PYTHONPATH": REPO}
    cli = [sys.executable, "-m", "hpc_tba.cli.main", "report"]
    one = subprocess.run([*cli, str(tmp_path / "sync")], capture_output=True, text=True, env=env, timeout=120)
    assert one.returncode == 0 and (tmp_path / "sync" / "report.png").is_file(), one.stderr
    both = subprocess.run([*cli, str(tmp_path / "sync"), str(tmp_path / "async"), "-o", str(tmp_path / "c.png")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert both.returncode == 0 and both.stdout.strip() == f"hpc-tba: wrote {tmp_path / 'c.png'}", both.stderr
    bad = subprocess.run([*cli, str(tmp_path / "nothing")], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "is not a run directory" in bad.stderr
