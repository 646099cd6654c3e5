"""hpc_tba."""
from hpc_tba.launcher.submit import launch  # noqa: F401  (submitit is imported on first call)
