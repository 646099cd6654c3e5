"""Typed configuration of where the job runs (`cluster=` group)."""
from __future__ import annotations

import dataclasses

BACKENDS = ("local", "slurm")


@dataclasses.dataclass
class ClusterConfig:
    """Rank layout and launcher. Learner ranks come first, then searcher ranks."""

    backend: str = "local"
    """local (mpiexec on this machine) or slurm (srun inside an allocation / sbatch)."""
    num_learners: int = 1
    """Learner ranks (one ZeRO-3 data-parallel group; each owns a replay-buffer shard)."""
    num_searchers: int = 2
    """Searcher ranks (each drives one vLLM engine)."""
    threads_per_rank: int = 1
    """CPU threads per rank (pinning matters: oversubscribed ranks slow small steps ~10x)."""
    dist_backend: str = "auto"
    """torch.distributed backend for ZeRO-3 and weight sync: auto (nccl on GPU, else gloo)."""
    mpiexec: str = "mpiexec"
    """MPI launcher for backend=local."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"cluster.backend={self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.num_learners < 1:
            raise ValueError("cluster.num_learners must be >= 1: someone has to train")
        if self.num_searchers < 0:
            raise ValueError("cluster.num_searchers must be >= 0")

    @property
    def world_size(self) -> int:
        return self.num_learners + self.num_searchers
