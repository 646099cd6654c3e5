"""The first hour of a user, on the real components (mpiexec, vLLM, DeepSpeed): a quiet terminal
with one summary, every rank's library output in its log, a failing rank reported once with a
non-zero exit, `hpc-tba status` mid-run and after, and report.png (one summary with two learners:
test_two_learners_e2e)."""
import re
import shutil
import subprocess
import time

import pytest
from conftest import HPC_TBA, hpc_tba_status

SUMMARY_LABELS = ("=== hpc_tba run summary ===", "learner steps", "trajectories in", "held-out pass@1",
                  "change", "wall clock", "logs", "report")


def _ours(line: str) -> bool:
    """A terminal line we print: `hpc-tba: ...`, the progress bar, or a line of the summary."""
    line = line.strip()
    return (not line or line.startswith("hpc-tba: ") or line.startswith(SUMMARY_LABELS)
            or all(part.startswith("learner:") for part in line.split("\r") if part))


@pytest.fixture
def broken_config(tmp_path):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    return d, "is not a valid JSON file"


@pytest.fixture
def missing_weights(tmp_path):
    from hpc_tba.assembly.compose import compose
    from hpc_tba.tasks.embedded import resolve_model_path

    cfg = compose([])
    d = tmp_path / "noweights"
    shutil.copytree(resolve_model_path(cfg.model, cfg.task), d)
    (d / "model.safetensors").unlink()
    return d, "no weights (none of model.safetensors.index.json, model.safetensors"


@pytest.mark.parametrize("model", ["broken_config", "missing_weights"])
def test_a_model_that_cannot_load_is_one_line_and_exit_1(model, tmp_path, request):
    model_dir, needle = request.getfixturevalue(model)
    run_dir = tmp_path / "run"
    t0 = time.time()
    proc = subprocess.run([HPC_TBA, "train", f"model.path={model_dir}", f"run_dir={run_dir}"],
                          capture_output=True, text=True, timeout=300)
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 1, terminal
    assert time.time() - t0 < 240  # the other ranks were ended, nobody waited for them
    failed = [line for line in terminal.splitlines() if " failed: " in line]
    assert len(failed) == 1 and terminal.count(needle) == 1, terminal
    m = re.match(r"hpc-tba: rank (\d+) failed: \w+: .*" + re.escape(needle) + r".* \(log: (\S+?)[;)]",
                 failed[0])
    assert m, failed[0]
    log = open(m.group(2)).read()
    assert "Traceback (most recent call last)" in log and needle in log  # the whole story, on disk
    assert all(_ours(line) for line in terminal.split("\n")), terminal


def test_default_run_is_quiet_reports_status_and_draws_its_report(default_run):
    """The default job's short run (conftest's, shared with the spine's tests): status while it
    ran and after, <= 40 terminal lines, all ours."""
    run_dir, summary, terminal, mid = default_run
    steps = summary["steps"]
    assert mid is not None, "status never showed the run running at a step > 0"
    assert 0 < mid["step"] < steps + 1 and mid["buffer_size"] > 0 and mid["pass@1_first"]["version"] == 0
    assert mid["host"] and mid["pid"] and mid["slurm_job_id"] is None

    after = hpc_tba_status(run_dir)
    assert after["state"] == "finished" and after["step"] == steps == summary["steps"]
    assert after["pass@1"] == {"version": steps, "value": summary["pass@1_after"]}
    from hpc_tba.checkpoint.store import latest_checkpoint

    assert after["checkpoint"] == latest_checkpoint(str(run_dir)) and after["checkpoint"].startswith(str(run_dir))
    assert 0.45 <= summary["pass@1_before"] <= 0.60  # the warm start's band, measured by vLLM

    lines = terminal.split("\n")  # terminal lines: the bar redraws one line with \r
    assert len(lines) <= 40, terminal
    assert [line for line in lines if not _ours(line)] == [], terminal
    assert not re.search(r"warn|deprecat|NUMA|triton|libiomp", terminal, re.I), terminal
    assert terminal.count("=== hpc_tba run summary ===") == 1
    logs = {p.name: p.read_text() for p in (run_dir / "logs").glob("rank*.log")}
    assert set(logs) == {"rank0.log", "rank1.log", "rank2.log"}
    assert "FutureWarning" in logs["rank0.log"]  # DeepSpeed's torch.distributed warnings: kept
    assert all("WARNING" in logs[f"rank{r}.log"] for r in (1, 2))  # vLLM's
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"report               {png}" in terminal

