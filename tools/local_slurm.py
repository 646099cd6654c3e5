"""A real Slurm on this machine for tests: a context manager around local_slurm.sh beside it.

Why a real one: sbatch scripts, `srun --mpi=pmi2` across (virtual) nodes and the requeue path are
exactly what a mock would get wrong. The daemons start in well under a second; readiness is the
script's handshake (`scontrol ping`, every node idle), and waiting for a job polls `scontrol`.

    with LocalSlurm("/tmp/hpc_tba_slurm", nodes=3) as slurm:
        job = slurm.sbatch(["slurm/tiny_cpu.sh"], cwd=run_dir)
        assert slurm.wait(job) == "COMPLETED"

A test harness, not part of the installed package: the tests import it as `local_slurm`
(tests/conftest.py puts tools/ on sys.path).
"""
from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "local_slurm.sh"
APT_INSTALL = ["apt-get", "install", "-y", "slurm-wlm", "munge"]
# Job states after which a job will not run again on its own.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def slurm_installed() -> bool:
    return all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch"))


def ensure_installed() -> str | None:
    """Install slurm-wlm and munge with apt if missing; None when ready, else the reason why not."""
    if slurm_installed():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm/munge absent and not installable here (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (APT_INSTALL, ["apt-get", "update"], APT_INSTALL):
        if subprocess.run(cmd, env=env, capture_output=True).returncode == 0 and slurm_installed():
            return None
    return "slurm-wlm/munge absent and `apt-get install -y slurm-wlm munge` failed"


def free_port_block(n: int, *, low: int = 20000, high: int = 40000, tries: int = 50) -> int:
    """A base port such that base .. base+n are all free (controller + one per virtual node).

    Lets concurrent test sessions each start their own cluster without colliding.
    """
    for _ in range(tries):
        base = random.randrange(low, high - n)
        try:
            for port in range(base, base + n + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no block of {n + 1} free ports in {low}-{high}")


class LocalSlurm:
    """munged + slurmctld + `nodes` slurmd virtual nodes, state under `state_dir`."""

    def __init__(self, state_dir: str | os.PathLike = "/tmp/hpc_tba_slurm", *, nodes: int = 3,
                 port: int = 16817, cpus_per_node: int = 2, timeout_s: float = 30.0) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.nodes, self.port, self.cpus_per_node = nodes, port, cpus_per_node
        self.timeout_s = timeout_s
        self.conf = self.state_dir / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF pointing at this cluster (pass to every Slurm client)."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def _script(self, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, HPC_TBA_SLURM_PORT=str(self.port),
                   HPC_TBA_SLURM_CPUS=str(self.cpus_per_node),
                   HPC_TBA_SLURM_TIMEOUT=str(int(self.timeout_s)))
        return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                              text=True, timeout=self.timeout_s * 3)

    def start(self) -> LocalSlurm:
        reason = ensure_installed()
        if reason:
            raise RuntimeError(reason)
        out = self._script("start", str(self.state_dir), str(self.nodes))
        if out.returncode:
            raise RuntimeError(f"local Slurm did not start:\n{out.stderr}")
        return self

    def stop(self) -> None:
        self._script("stop", str(self.state_dir))

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def run(self, args: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster; raises with its stderr on failure."""
        out = subprocess.run(list(args), env=kw.pop("env", self.env), capture_output=True,
                             text=True, **kw)
        if out.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def sbatch(self, args: Sequence[str], *, cwd: str | os.PathLike | None = None,
               env: Mapping[str, str] | None = None) -> str:
        """Submit and return the job id."""
        full_env = self.env | dict(env or {})
        out = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=full_env)
        return out.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, RestartCnt, ExitCode, NodeList, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, *, timeout_s: float = 300.0,
             states: set[str] = FINAL_STATES, abandon=None) -> str:
        """Poll until the job reaches one of `states`; return that state. `abandon()` returning
        True (e.g. a task's log shows MPI_Init failed while another task still waits in it)
        cancels the job and returns "CANCELLED"."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.job_info(job_id).get("JobState", "")
            if state in states:
                return state
            if abandon is not None and abandon():
                self.run(["scancel", job_id])
                return "CANCELLED"
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout_s:.0f}s")
            time.sleep(0.2)

    @staticmethod
    def wait_for_files(paths: Sequence[os.PathLike], *, timeout_s: float = 120.0) -> None:
        """Poll until every path exists: a job's own handshake (e.g. ranks wrote `ready`)."""
        deadline = time.monotonic() + timeout_s
        while not all(Path(p).exists() for p in paths):
            if time.monotonic() > deadline:
                missing = [str(p) for p in paths if not Path(p).exists()]
                raise TimeoutError(f"still missing after {timeout_s:.0f}s: {missing}")
            time.sleep(0.1)
