"""CPU twin of the GPU role check (tools/role_check.py; tests/test_gpu.py runs it on CUDA): the
real Learner built by hpc_tba.assembly.build, trajectories replayed over the real MPI transport by another
rank, two micro-batched train steps, a sync through the real WeightSender/WeightReceiver (the
received weights equal the learner's), a checkpoint and an export that loads back. MPI: run
under the heavy lock with the other end-to-end tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_role_check(tmp_path, *, accelerator: str = "cpu", timeout_s: float = 400) -> dict:
    """Record, then replay through tools/role_check.py on 2 MPI ranks; DeepSpeed on `accelerator`."""
    from hpc_tba.launcher.local import find_mpiexec, rank_env

    mpiexec = find_mpiexec("mpiexec")
    assert mpiexec is not None, "mpiexec not found"
    script = os.path.join(ROOT, "tools", "role_check.py")
    rec = str(tmp_path / "traj.npz")
    subprocess.run([sys.executable, script, "--record", rec], check=True, timeout=60)
    env = rank_env(1)
    env["DS_ACCELERATOR"] = accelerator  # conftest defaults every test process to cpu
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.setdefault("HPC_TBA_MASTER_ADDR", "127.0.0.1")
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, script, "--recording", rec,
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((tmp_path / "role_check.json").read_text())


def check_report(report: dict, device_type: str) -> None:
    assert report["device"].startswith(device_type), report
    assert report["received"] == 6 and report["finite"], report
    assert report["weights_match"], "the weights the replayer received differ from the learner's"
    assert report["export_matches"] and report["checkpoint"], report


def test_role_check_on_cpu(tmp_path):
    check_report(run_role_check(tmp_path), "cpu")
