"""Planning a run before it is queued: `hpc-tba plan` (planner), its dry run on the meta device
(dryrun), the learner's, checkpoint's, NCCL's and weight sync's rows, and the memory arithmetic
they share (memory). Nothing here is imported by a rank at run time except for its figures."""
