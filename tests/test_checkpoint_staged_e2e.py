"""Staged checkpoints in a real run (mpiexec, vLLM, DeepSpeed, real signals): saves staged to a
node-local directory are committed by the learner's per-step agreement while training goes on,
and a SIGUSR1 that lands while a copy is in flight leaves only complete checkpoints (the copy
dropped whole, the final save written directly), which `resume=auto` continues from."""
import json
import os
import signal
import subprocess
import time

import pytest
from conftest import HPC_TBA
from test_resume import _ranks, _steps, _wait_for_step

DELAY_S = 0.5  # per file copied (5 files: DeepSpeed's 2, rank0.json, rng, learner.json)
COMMON = ["learner.eval_every=0", "buffer.warm_start=100", "learner.export_final=false"]


def _rows(run_dir, key):
    path = os.path.join(run_dir, "metrics_learner.jsonl")
    return [r[key] for r in map(json.loads, open(path)) if key in r] if os.path.exists(path) else []


def _usr1_mid_copy(proc, run_dir) -> None:
    """Wait for a committed staged save, then for the next copy in flight; USR1 every rank."""
    _wait_for_step(proc, run_dir, 6)
    deadline, root = time.time() + 600, run_dir / "checkpoints"
    while not _rows(run_dir, "checkpoint/committed_step"):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    while not any(d.startswith(".tmp-") for d in os.listdir(root)):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    for p in _ranks(proc):
        p.send_signal(signal.SIGUSR1)
    proc.wait(timeout=300)


@pytest.mark.long
def test_staged_saves_commit_while_training_and_usr1_mid_copy_leaves_only_complete_ones(tmp_path):
    run_dir, local = tmp_path / "run", tmp_path / "node_local"
    args = [*COMMON, "learner.checkpoint_every=6", f"cluster.checkpoint_staging_dir={local}"]
    env = dict(os.environ, HPC_TBA_FAULT_SLOW_CKPT_COPY_S=str(DELAY_S))
    log = tmp_path / "train.out"  # a file, not a pipe: 200 steps of progress bars would fill one
    proc = subprocess.Popen([HPC_TBA, "train", *args, "learner.total_steps=200", f"run_dir={run_dir}"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        _usr1_mid_copy(proc, run_dir)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == 0, log.read_text()[-3000:]
    root = run_dir / "checkpoints"
    summary = json.loads((run_dir / "summary.json").read_text())
    step = summary["steps"]
    assert summary["preempted"] and step < 200
    names = sorted(os.listdir(root))
    assert not [d for d in names if d.startswith(".tmp-")], names
    assert all((root / d / "COMPLETE").exists() for d in names if d.startswith("step_")), names
    assert (root / "latest").read_text() == f"step_{step:06d}"
    assert not [p for p in local.rglob("*") if p.is_file()]  # nothing staged left on the node
    committed = _rows(run_dir, "checkpoint/committed_step")
    assert committed and all(c % 6 == 0 for c in committed)
    stalls = _rows(run_dir, "checkpoint/time_s")
    assert min(stalls) < DELAY_S * 5 / 2, stalls  # staged saves did not wait for their 5-file copy

    finish = step + 3
    proc = subprocess.Popen([HPC_TBA, "train", *COMMON, f"learner.total_steps={finish}", "resume=auto",
                             f"run_dir={run_dir}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    assert _rows(run_dir, "checkpoint/resumed_step") == [step]
    assert [r["step"] for r in _steps(run_dir)][-3:] == [step + 1, step + 2, finish]
