"""hpc_tba."""
