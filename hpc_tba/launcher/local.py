"""The rank command, and how this machine starts every rank of a job with mpiexec.

One rank command (`rank_command`: `python -m hpc_tba.cli.rank <overrides>`) is what every launcher
starts on each rank: `hpc-tba train` and submitit's local executor through `mpiexec_launch`
here, the generated sbatch scripts through `launcher.slurm.srun_command`; submitit's Slurm
executor calls the same entry (`hpc_tba.cli.rank.main`) in each task.
"""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence

ENTRY = "hpc_tba.cli.rank"
"""The per-rank entry module (hpc_tba/cli/rank.py)."""


def rank_command(overrides: Sequence[str], *, python: str | None = None) -> list[str]:
    """argv of one rank: the entry module under `python` (default: this interpreter)."""
    return [python or sys.executable, "-m", ENTRY, *overrides]


def find_mpiexec(name: str) -> str | None:
    """The MPI launcher: next to this Python first (the mpich wheel installs it there)."""
    local = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.isfile(local) and os.access(local, os.X_OK):
        return local
    return shutil.which(name)


def default_extensions_dir() -> str:
    """DeepSpeed's compiled ops, per Python environment: the build embeds the environment's
    include paths, so two environments sharing one directory would rebuild it for each other
    (~1.5 min every time). tools/install.sh builds it here once."""
    return os.path.join(sys.prefix, "torch_extensions")


def rank_env(threads: int) -> dict[str, str]:
    """Environment every rank starts with: pinned threads, CPU DeepSpeed when there is no GPU."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", default_extensions_dir())
    try:
        import torch

        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")
    except ImportError:
        pass
    return env


def mpiexec_launch(mpiexec: str, world_size: int, overrides: Sequence[str],
                   threads: int) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start `world_size` ranks of the run on this machine.

    `mpiexec` is the launcher's path (see `find_mpiexec`). The rendezvous stays on this machine
    (HPC_TBA_MASTER_ADDR, unless the caller's environment names another address).
    """
    env = rank_env(threads)
    env.setdefault("HPC_TBA_MASTER_ADDR", "127.0.0.1")
    return [mpiexec, "-n", str(world_size), *rank_command(overrides)], env
