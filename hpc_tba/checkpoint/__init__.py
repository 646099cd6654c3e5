"""What a run keeps on disk: atomic learner checkpoints (store), their staging on node-local disk
(staging), and the run directory's plain files (runfiles, torch-free: `hpc-tba status` reads them)."""
