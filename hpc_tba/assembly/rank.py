"""One rank set-up: everything a rank does before building its role, in one call.

`setup_rank(cfg)` is called once per rank by hpc_tba.run (and by tools/role_check.py):

1. the transport (MPI unless one is passed: anything with `rank` and `size`),
2. the layout (`Topology.for_run`, the same call the sbatch script, submitit and the planner
   make), checked against the job's real size,
3. under Slurm: the check that srun placed this rank where the layout says, and the GPU pinning
   (CUDA_VISIBLE_DEVICES, before anything initialises CUDA),
4. the preemption signals (Slurm's USR1, submitit's signal, SIGTERM) routed to one flag,
5. CPU threads per rank, and on one machine (cluster.backend=local) the core pinning.
"""
from __future__ import annotations

import dataclasses
import os
import signal
from typing import Any

from hpc_tba.launcher.slurm import (
    PreemptionFlag,
    SlurmEnv,
    check_placement,
    cuda_visible_devices,
    install_preemption_handler,
    preemption_signals,
)
from hpc_tba.topology import Role, Topology


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """What a rank knows once it is set up."""

    transport: Any
    """How it talks to the other ranks (MPITransport on a real job)."""
    topology: Topology
    """The job's layout (validated against the transport's size)."""
    role: Role
    """The role this rank plays."""
    slurm: SlurmEnv | None
    """The Slurm view of this task; None off Slurm."""
    preemption: PreemptionFlag
    """Set by a preemption signal; roles act on it at a step boundary."""

    @property
    def rank(self) -> int:
        return self.transport.rank


def setup_rank(cfg, transport: Any = None, *, preemption: PreemptionFlag | None = None) -> RankSetup:
    """Transport, layout, placement check, GPU pinning, preemption signals, thread/core pinning.

    `preemption`: a flag the caller already routes the signals to, for ranks that share one
    process as threads (hpc_tba.assembly.inprocess): the process-wide set-up (signal handlers,
    which only the main thread may install; Slurm's placement check and GPU pinning, which are
    per process) is then the caller's.
    """
    if transport is None:
        from hpc_tba.comm.transport import MPITransport

        transport = MPITransport()
    rank = transport.rank
    topo = Topology.for_run(cfg, transport.size)
    env = SlurmEnv.from_environ() if preemption is None else None
    check_placement(topo, rank, env)
    if env is not None and cfg.cluster.gpus_per_node:  # before anything initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(topo, rank)
    # Every rank takes the signals (an unhandled SIGUSR1 would kill a searcher); learners act on
    # them at the next step boundary: checkpoint together, stop the searchers, exit.
    if preemption is None:
        preemption = install_run_signals()
    pin_threads(cfg.cluster.threads_per_rank)
    if cfg.cluster.backend == "local" and cfg.cluster.pin_cores:
        pin_cores(rank, topo)
    return RankSetup(transport, topo, topo.role(rank), env, preemption)


def install_run_signals() -> PreemptionFlag:
    """Route a run's stop signals (Slurm's / submitit's preemption signal, SIGTERM) to one flag;
    main thread only (Python's rule for signal handlers)."""
    return install_preemption_handler((*preemption_signals(), signal.SIGTERM))


def pin_threads(n: int) -> None:
    """torch's intra-op threads (and OpenMP's, unless the launcher set them) to n."""
    import torch

    torch.set_num_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))


def cores_for_rank(rank: int, topo: Topology, ncpu: int) -> set[int]:
    """CPU cores a rank may run on when several ranks share one machine.

    Learners get cores of their own first (training is the heavier, latency-critical work: a
    learner sharing its core with a searcher ran ~6x slower per step here); searchers share the
    remaining cores round-robin, or every core when none is left.
    """
    if topo.role(rank) is Role.LEARNER:
        return {rank % ncpu}
    free = list(range(topo.num_learners, ncpu)) or list(range(ncpu))
    return {free[topo.searcher_index(rank) % len(free)]}


def pin_cores(rank: int, topo: Topology) -> None:
    """Pin this process to its cores, on a small shared machine only (not a cluster node)."""
    cpus = sorted(os.sched_getaffinity(0))  # the cores this job may use, whatever their numbers
    if 1 < len(cpus) <= topo.world_size * 4:
        os.sched_setaffinity(0, {cpus[i] for i in cores_for_rank(rank, topo, len(cpus))})
