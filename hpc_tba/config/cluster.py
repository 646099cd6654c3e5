"""Typed configuration of where the job runs (`cluster=` group)."""
from __future__ import annotations

import dataclasses
import re

from hpc_tba.config.ranges import check_ranges, ranged

BACKENDS = ("local", "slurm")
# Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")


@dataclasses.dataclass
class ClusterConfig:
    """Rank layout and launcher. Learner ranks come first, then searcher ranks."""

    backend: str = "local"
    """local (mpiexec on this machine) or slurm (srun inside an allocation / sbatch)."""
    num_learners: int = ranged(1, ge=1, note="someone has to train")
    """Learner ranks (one ZeRO-3 data-parallel group; each owns a replay-buffer shard)."""
    num_searchers: int = ranged(2, ge=0)
    """Searcher ranks (each drives one vLLM engine)."""
    threads_per_rank: int = ranged(1, ge=1)
    """CPU threads per rank (pinning matters: oversubscribed ranks slow small steps ~10x)."""
    engine_threads: int = ranged(1, ge=1)
    """OpenMP/MKL threads of each process of an out-of-process vLLM engine (its engine core and
    each tensor-parallel worker, which mostly wait on the GPU); a searcher task gets
    threads_per_rank + (1 + TP) x engine_threads CPUs (cli.sbatch.role_cpus)."""
    cpus_per_node: int = ranged(0, ge=0, note="0: unchecked")
    """CPUs Slurm can give per node, to check that every node's tasks get theirs (0: unchecked)."""
    dist_backend: str = "auto"
    """torch.distributed backend for ZeRO-3 and weight sync: auto (nccl on GPU, else gloo)."""
    mpiexec: str = "mpiexec"
    """MPI launcher for backend=local."""
    pin_cores: bool = True
    """backend=local: pin each rank to cores (learners get their own core first)."""
    nodes: int = ranged(1, ge=1)
    """Nodes in the Slurm allocation (learners on whole nodes first, then searcher engines)."""
    gpus_per_node: int = ranged(0, ge=0, note="0: CPU nodes")
    """GPUs per node (0: CPU nodes); a learner rank takes one, a searcher engine its TP size."""
    ranks_per_node: int = ranged(0, ge=0, note="0: all ranks on one node")
    """CPU nodes only: rank slots per node (0: all ranks on one node)."""
    gpu_memory_gb: float = ranged(80.0, gt=0)
    """Memory of one GPU in GB (10^9 bytes), for the planner."""
    host_memory_gb: float = ranged(0.0, ge=0, note="0: not checked")
    """Host memory per node in GB (10^9 bytes): `hpc-tba plan` checks every node kind's host
    bytes against it (0: not checked); `hpc-tba doctor` checks the node's real memory
    (/proc/meminfo) against the plan at run time either way."""
    network_gbit_per_s: float = ranged(100.0, gt=0)
    """Line rate of one network interface between nodes, Gbit/s (InfiniBand NDR: 400; HDR: 200;
    100 GbE: 100). The planner times cross-node traffic with it; `hpc-tba doctor` compares a
    measured cross-node all-reduce with it."""
    nics_per_node: int = ranged(1, ge=1)
    """Network interfaces per node NCCL spreads traffic over (an 8-GPU node often has 4 or 8)."""
    partition: str = ""
    """Slurm partition (--partition); empty: the site default."""
    account: str = ""
    """Slurm account (--account); empty: the user's default."""
    time: str = "01:00:00"
    """Slurm time limit (--time), e.g. 2-00:00:00."""
    signal_grace_s: int = ranged(300, ge=0)
    """Seconds before the time limit Slurm sends USR1 (--signal): time to checkpoint and requeue."""
    checkpoint_gb_per_s: float = ranged(1.0, gt=0, note="the shared filesystem's write bandwidth in GB/s")
    """Write bandwidth of the shared filesystem to all learner ranks together, GB/s (planner)."""
    checkpoint_staging_dir: str = ""
    """Node-local dir learners save into first, copied to run_dir in the background; empty: none."""
    requeue: bool = True
    """Requeue the job after preemption or a USR1 checkpoint (--requeue)."""
    exclusive: bool = False
    """Ask for whole nodes (--exclusive); GPU presets set it."""
    mpi: str = "pmi2"
    """srun --mpi plugin matching the MPI that mpi4py uses (pmi2 for MPICH, pmix for Open MPI)."""
    shared_dir: str = ""
    """Shared filesystem root for run directories on Slurm; empty: the submit directory."""
    setup: str = ""
    """Shell lines the sbatch script runs before srun (module load, venv activation)."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment for every rank (e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA)."""
    smoke_preempt_step: int = ranged(0, ge=0, note="0: not a smoke job")
    """A smoke job (`+experiment=tba_8b_smoke`): once the learner has logged this step on the
    job's first start, the sbatch script sends USR1 to every rank, as Slurm's --signal does before
    a time limit (every role checkpoints, rank 0 requeues, the job resumes), and after the run it
    prints the PASS/FAIL verdict of hpc_tba.cli.smoke. 0: an ordinary job."""

    def __post_init__(self) -> None:
        check_ranges(self, "cluster")
        if self.backend not in BACKENDS:
            raise ValueError(f"cluster.backend={self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.nodes > 1 and not (self.gpus_per_node or self.ranks_per_node):
            raise ValueError(f"cluster.nodes={self.nodes}: set cluster.gpus_per_node (GPU nodes) "
                             "or cluster.ranks_per_node (CPU nodes) so ranks can be placed")
        if self.smoke_preempt_step and not (self.backend == "slurm" and self.requeue):
            raise ValueError(f"cluster.smoke_preempt_step={self.smoke_preempt_step} preempts and "
                             "requeues a Slurm job: it needs cluster.backend=slurm and cluster.requeue=true")
        if not _TIME.match(self.time):
            raise ValueError(f"cluster.time={self.time!r} is not a Slurm time (e.g. 04:00:00, "
                             "2-00:00:00, 90)")

    @property
    def world_size(self) -> int:
        return self.num_learners + self.num_searchers
