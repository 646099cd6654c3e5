"""Shared test setup: CPU-only, one thread per process, DeepSpeed on its CPU accelerator."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HPC_TBA_NO_PROGRESS", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What tests use but the installed package does not ship: the simulator, the local-Slurm harness and
# the experiment runner under tools/ (imported as `simulator`, `local_slurm`, `experiments`); test
# helpers such as buffer_helpers.py sit beside the tests (pytest puts tests/ on sys.path).
sys.path.insert(0, os.path.join(REPO, "tools"))
HPC_TBA = os.path.join(os.path.dirname(sys.executable), "hpc-tba")


def gloo_deepspeed(rank: int, world: int, port: int) -> None:
    """In a spawned test worker: DeepSpeed's CPU accelerator and a `world`-rank gloo group on
    localhost, as a learner rank has them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed

    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, rank=rank, world_size=world,
                               init_method=f"tcp://127.0.0.1:{port}", verbose=False)
