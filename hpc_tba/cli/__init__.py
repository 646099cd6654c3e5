"""The command line: `hpc-tba` (main) and its commands (eval, data, status, report, doctor,
smoke), a rank's own entry point (`python -m hpc_tba.cli.rank`), submitit's `hpc_tba.launch`
(submit) and the generated sbatch scripts (sbatch, scripts)."""
