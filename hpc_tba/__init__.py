"""hpc_tba: `hpc_tba.compose(overrides)` -> a RunConfig; `hpc_tba.launch(cfg, executor=...)` -> a job."""
from hpc_tba.assembly.compose import compose  # noqa: F401  (Hydra is imported on first call)
from hpc_tba.launcher.submit import launch  # noqa: F401  (submitit is imported on first call)
