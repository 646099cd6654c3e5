"""Checkpoint, kill, resume: real processes (mpiexec, vLLM, DeepSpeed), real signals.

One run goes through both, in this order (three starts instead of four for a run each):
- SIGUSR1 (Slurm's `--signal=USR1@grace`) to every rank: all learners checkpoint at the same
  step, the searchers are drained and stopped, the run exits within the grace time; `resume=auto`
  then continues it from that step.
- SIGKILL of the whole resumed run, then `resume=auto`: the run continues from its latest
  checkpoint to the end, and every (prompt, response) the buffer had acknowledged before the kill
  is still there.
"""
import json
import os
import signal
import subprocess
import time

import psutil
import pytest
from conftest import HPC_TBA

# One searcher: the signals, the drain and the buffer's acknowledgements are the same with more,
# and a second engine on two cores made the three starts 164 s instead of 95 s (quiet machine).
COMMON = ["learner.eval_every=0", "buffer.warm_start=100", "learner.export_final=false",
          "cluster.num_searchers=1"]


def _start(run_dir, *args):
    return subprocess.Popen([HPC_TBA, "train", *COMMON, *args, f"run_dir={run_dir}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _steps(run_dir):
    path = os.path.join(run_dir, "metrics_learner.jsonl")
    if not os.path.exists(path):
        return []
    return [r for r in map(json.loads, open(path)) if "loss/tb" in r]


def _wait_for_step(proc, run_dir, step, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = _steps(run_dir)
        if rows and rows[-1]["step"] >= step:
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    raise TimeoutError(f"no step {step} within {timeout}s")


def _ranks(proc):
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "hpc_tba.cli.rank" in " ".join(p.cmdline())]


def _live_pairs(shard):
    """(prompt id, response tokens) of every response the shard holds."""
    import numpy as np

    st = shard.store
    live = st.live_slots()
    out = set()
    for slot in live:
        pid = int(st.s["pid"][slot])
        start, length = int(st.s["off"][slot]), int(st.s["len"][slot])
        out.add((pid, tuple(np.asarray(st.tok[start:start + length]).tolist())))
    return out


def _live_pairs_of(run_dir):
    from hpc_tba.buffer import BufferShard
    from hpc_tba.config import BufferConfig

    return _live_pairs(BufferShard.load(os.path.join(run_dir, "buffer"), BufferConfig(warm_start=0)))


def _resumed_steps(run_dir):
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics_learner.jsonl"))]
    return [r["checkpoint/resumed_step"] for r in rows if "checkpoint/resumed_step" in r]


@pytest.mark.parametrize("grace_s", [60])
def test_sigusr1_then_sigkill_each_resumed_by_resume_auto(tmp_path, grace_s):
    run_dir = tmp_path / "run"
    # SIGUSR1 to every rank: one checkpoint at the same step, exit within the grace time
    proc = _start(run_dir, "learner.total_steps=40")
    _wait_for_step(proc, run_dir, 6)
    t0 = time.time()
    for p in _ranks(proc):
        p.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=grace_s * 3)
    took = time.time() - t0
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["preempted"] is True and summary["signal"] == signal.SIGUSR1
    step = summary["steps"]
    assert 6 <= step < 40
    assert (run_dir / "checkpoints" / f"step_{step:06d}" / "COMPLETE").exists()
    assert took < grace_s, f"checkpoint and exit took {took:.0f}s"

    # resume=auto continues from the USR1 checkpoint; SIGKILL of the whole run two steps after
    # its first periodic checkpoint leaves that one as the latest
    periodic = (step // 4 + 1) * 4
    proc = _start(run_dir, "learner.total_steps=40", "learner.checkpoint_every=4", "resume=auto")
    _wait_for_step(proc, run_dir, periodic + 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _resumed_steps(run_dir) == [step]
    steps = [r["step"] for r in _steps(run_dir)]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= periodic + 2, steps
    before = _live_pairs_of(run_dir)
    assert before
    ckpt = open(run_dir / "checkpoints" / "latest").read().strip()
    saved_step = int(ckpt.split("_")[1])
    assert saved_step >= periodic and saved_step % 4 == 0

    # resume=auto again: from the latest checkpoint to the end, nothing acknowledged lost
    finish = saved_step + 4  # a few steps past the checkpoint show the run continues from it
    proc = _start(run_dir, f"learner.total_steps={finish}", "learner.checkpoint_every=4", "resume=auto")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == finish and not summary["preempted"]
    assert _resumed_steps(run_dir) == [step, saved_step]
    after_resume = [r["step"] for r in _steps(run_dir)][-(finish - saved_step):]
    assert after_resume == list(range(saved_step + 1, finish + 1))
    assert before <= _live_pairs_of(run_dir)  # nothing acknowledged before the kill was lost
