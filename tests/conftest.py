"""Shared test setup: CPU-only, one thread per process, DeepSpeed on its CPU accelerator."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HPC_TBA_NO_PROGRESS", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HPC_TBA = os.path.join(os.path.dirname(sys.executable), "hpc-tba")
