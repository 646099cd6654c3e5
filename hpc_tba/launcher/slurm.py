"""What Slurm tells a rank and does to it: the SLURM_* environment, placement, USR1, requeue.

The sbatch text and srun lines that start the ranks are the command line's (hpc_tba/cli/sbatch.py).
Why one module for the rank's side: a site's Slurm differs in a handful of details (signal
semantics, the node list's syntax); keeping them here means the rest of the code only sees a
`SlurmEnv` and a flag.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

from hpc_tba.config.topology import LayoutError, Topology


# ---- the environment a rank sees ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SlurmEnv:
    """What Slurm tells one task about its job (srun/sbatch set these variables)."""

    job_id: str
    """SLURM_JOB_ID; unchanged by a requeue, so it names the run directory."""
    node_list: tuple[str, ...]
    """Hostnames of the allocation in Slurm's order (SLURM_JOB_NODELIST expanded)."""
    node_name: str
    """This task's node (SLURMD_NODENAME; a virtual node's name on the test cluster)."""
    node_id: int
    """Index of this task's node in the step's node list (SLURM_NODEID)."""
    proc_id: int
    """Global task rank in the step (SLURM_PROCID); equals the MPI rank under srun --mpi."""
    ntasks: int
    """Tasks in the step (SLURM_NTASKS)."""
    local_id: int
    """Task index on its node (SLURM_LOCALID)."""
    restart_count: int
    """How many times the job was requeued (SLURM_RESTART_COUNT, 0 on the first run)."""
    submit_dir: str
    """Directory sbatch was called from (SLURM_SUBMIT_DIR)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SlurmEnv | None:
        """The Slurm view of this process, or None outside a Slurm job."""
        env = os.environ if environ is None else environ
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
        return cls(
            job_id=job_id,
            node_list=tuple(nodes),
            node_name=env.get("SLURMD_NODENAME", ""),
            node_id=int(env.get("SLURM_NODEID", 0)),
            proc_id=int(env.get("SLURM_PROCID", 0)),
            ntasks=int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or 1),
            local_id=int(env.get("SLURM_LOCALID", 0)),
            restart_count=int(env.get("SLURM_RESTART_COUNT", 0)),
            submit_dir=env.get("SLURM_SUBMIT_DIR", ""),
        )


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list ("gpu[001-003,007],login1") without calling scontrol."""
    hosts: list[str] = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", nodelist):
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    return hosts


def check_placement(topology: Topology, rank: int, env: SlurmEnv | None) -> None:
    """Fail fast, in words, when srun's placement disagrees with the topology the config builds.

    Catches an sbatch script whose #SBATCH lines no longer match the config it is run with.
    """
    if env is None:
        return
    if env.ntasks != topology.world_size:
        raise LayoutError(
            f"the job step has {env.ntasks} tasks but the config's layout needs "
            f"{topology.world_size}; regenerate the sbatch script from this config")
    if topology.slots_per_node and env.node_id != topology.node_of(rank):
        raise LayoutError(
            f"rank {rank} runs on node index {env.node_id} ({env.node_name}) but the topology "
            f"places it on node {topology.node_of(rank)}; was srun given the host file?")


def cuda_visible_devices(topology: Topology, rank: int) -> str:
    """CUDA_VISIBLE_DEVICES for a rank: its learner GPU, or the TP group of its engine."""
    return ",".join(str(d) for d in topology.devices_of(rank))


# ---- preemption: USR1 -> flag -> checkpoint -> requeue --------------------------------------
class PreemptionFlag:
    """Set from a signal handler; roles poll `is_set()` at step boundaries and checkpoint.

    The handler does nothing else: checkpointing inside a signal handler would run in the middle
    of a collective. Thread-safe (a threading.Event), so helper threads may wait on it too.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signum: int | None = None
        self.received_at: float | None = None

    def set(self, signum: int) -> None:
        self.signum, self.received_at = signum, time.time()
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


def preemption_signals(environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """USR1 (our sbatch scripts' --signal), plus submitit's signal under a submitit Slurm job."""
    env = os.environ if environ is None else environ
    sigs = [signal.SIGUSR1]
    if env.get("SUBMITIT_EXECUTOR") == "slurm":
        name = env.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
        sigs.append(getattr(signal, f"SIG{name}"))
    return tuple(dict.fromkeys(sigs))


def install_preemption_handler(signals: Sequence[int] | None = None) -> PreemptionFlag:
    """Route Slurm's `--signal=USR1@grace` (and submitit's signal) to a PreemptionFlag.

    Call from the main thread of each rank, once, before the run loop. Under submitit this
    replaces submitit's own handler, so every role checkpoints before rank 0 requeues.
    """
    signals = preemption_signals() if signals is None else signals
    flag = PreemptionFlag()

    def _handler(signum: int, _frame: object) -> None:
        flag.set(signum)

    for sig in signals:
        signal.signal(sig, _handler)
    return flag


def requeue(job_id: str | None = None, *, scontrol: str = "scontrol") -> None:
    """Ask Slurm to requeue this job (same job id, SLURM_RESTART_COUNT + 1).

    Call after every rank has written its checkpoint (rank 0 is enough): Slurm then kills all
    tasks, so nothing after this call is guaranteed to run. A second call from another rank
    finds the job already requeued ("pending execution") and returns quietly.
    """
    job_id = job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise RuntimeError("requeue() outside a Slurm job: no SLURM_JOB_ID")
    out = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True)
    if out.returncode and "pending" not in out.stderr.lower():
        raise RuntimeError(f"scontrol requeue {job_id} failed: {out.stderr.strip()}")
