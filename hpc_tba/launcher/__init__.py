"""What starts a rank and what a rank learns from its starter: Slurm's environment, placement and
signals (slurm), the mpiexec command line (local), and each rank's console and failure records
(console)."""
