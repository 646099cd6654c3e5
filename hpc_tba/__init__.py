"""hpc_tba: `hpc_tba.compose(overrides)` -> a RunConfig; `hpc_tba.launch(cfg, executor=...)` -> a job.

On import, an installed vLLM, DeepSpeed, torch, transformers or tokenizers other than the release
in hpc_tba/pins.py is named in one line on stderr (package metadata only; HPC_TBA_NO_PIN_CHECK=1
silences it): results may differ from the tested ones, and that should not go unnoticed.
"""
from hpc_tba.pins import check_installed

check_installed()

from hpc_tba.assembly.compose import compose  # noqa: E402, F401  (Hydra is imported on first call)
from hpc_tba.cli.submit import launch  # noqa: E402, F401  (submitit is imported on first call)
