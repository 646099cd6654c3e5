"""One rank set-up: everything a rank does before building its role, in one call.

`setup_rank(cfg)` is called once per rank by hpc_tba.cli.rank (and by tools/role_check.py):

1. the GPU placement (`place_devices`: CUDA_VISIBLE_DEVICES from the layout and the launcher's
   rank variables, SLURM_PROCID / SLURM_LOCALID or Open MPI's, MPICH's, PMIx's, Cray's), BEFORE
   mpi4py is imported: a CUDA-aware MPI (Open MPI/UCX, MVAPICH2-GDR, Cray MPICH) initialises
   CUDA inside MPI_Init, after which every rank of a node would see GPU 0 (hpc_tba.cli.rank places
   even earlier, before its own MPI start);
2. the transport (MPI unless one is passed: anything with `rank` and `size`), and the check
   that MPI's rank is the rank the GPUs were given for,
3. the layout (`Topology.for_run`, the same call the sbatch script, submitit and the planner
   make), checked against the job's real size,
4. under Slurm: the check that srun placed this rank where the layout says,
5. the preemption signals (Slurm's USR1, submitit's signal, SIGTERM) routed to one flag,
6. CPU threads per rank, and on one machine (cluster.backend=local) the core pinning.
"""
from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import MutableMapping
from typing import Any

from hpc_tba.config.topology import LayoutError, Role, Topology
from hpc_tba.launcher.slurm import (
    PreemptionFlag,
    SlurmEnv,
    check_placement,
    cuda_visible_devices,
    install_preemption_handler,
    preemption_signals,
)

# The launcher's names for this process's rank, node-local index and job size before MPI starts,
# first match wins: Open MPI's mpirun, MPICH/Hydra and Intel MPI (PMI_*, MPI_LOCALRANKID), PMIx
# launchers, Cray PALS, then srun (which also sets PMI_RANK under --mpi=pmi2). A variable left
# over from an enclosing job is caught by the check after MPI starts (`check_placed_rank`).
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "PALS_RANKID", "SLURM_PROCID")
LOCAL_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID", "SLURM_LOCALID")
SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "PALS_SIZE", "SLURM_NTASKS")


def _first(env: MutableMapping[str, str], names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        if env.get(name, "").strip().isdigit():
            return name, int(env[name])
    return None


def place_devices(cfg, environ: MutableMapping[str, str] | None = None) -> int | None:
    """Set CUDA_VISIBLE_DEVICES for this process from the layout, before MPI starts.

    The rank (and job size) come from the launcher's variables (RANK_VARS), the GPUs from
    `Topology.devices_of(rank)`: a learner's one GPU, or its engine's TP group. The launcher's
    node-local index must be the layout's (else the ranks were placed otherwise than the layout
    says and GPUs would be shared). Returns the rank the GPUs were given for; None when the
    cluster has no GPUs. A second call (hpc_tba.cli.rank, then setup_rank) computes the same.
    """
    env = os.environ if environ is None else environ
    if not cfg.cluster.gpus_per_node:
        return None
    rank_var, size_var = _first(env, RANK_VARS), _first(env, SIZE_VARS)
    rank = rank_var[1] if rank_var else 0
    topo = Topology.for_run(cfg, size_var[1] if size_var else None)
    local = _first(env, LOCAL_VARS)
    if local is not None and local[1] != topo.local_rank(rank):
        raise LayoutError(
            f"rank {rank} ({rank_var[0] if rank_var else 'no rank variable'}) is task {local[1]} of "
            f"its node ({local[0]}), but the layout makes it task {topo.local_rank(rank)} there, "
            f"with GPU(s) {cuda_visible_devices(topo, rank)}; start the ranks with the layout's "
            "host file (slurm/*.sh, `hpc-tba train`)")
    env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(topo, rank)
    return rank


def check_placed_rank(placed: int | None, mpi_rank: int, environ=None) -> None:
    """After MPI started: the GPUs were given for the rank MPI says this process is."""
    if placed is None or placed == mpi_rank:
        return
    env = os.environ if environ is None else environ
    seen = ", ".join(f"{k}={env[k]}" for k in RANK_VARS if k in env) or "no rank variable"
    raise LayoutError(
        f"this process was given the GPU(s) of rank {placed} before MPI started ({seen}), but MPI "
        f"says it is rank {mpi_rank}: the launcher's rank variables disagree with MPI's; start the "
        "job with one launcher (srun, or mpiexec outside srun)")


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
    """GPU placement, transport, layout, placement checks, preemption signals, thread/core pinning.

    `preemption`: a flag the caller already routes the signals to, for ranks that share one
    process as threads (hpc_tba.assembly.inprocess): the process-wide set-up (signal handlers,
    which only the main thread may install; Slurm's placement check and GPU pinning, which are
    per process) is then the caller's.
    """
    placed = place_devices(cfg) if preemption is None else None  # before mpi4py is imported
    if transport is None:
        from hpc_tba.comm.transport import MPITransport

        transport = MPITransport()
    rank = transport.rank
    check_placed_rank(placed, rank)
    topo = Topology.for_run(cfg, transport.size)
    env = SlurmEnv.from_environ() if preemption is None else None
    check_placement(topo, rank, env)
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
