"""Per-rank entry point: `python -m hpc_tba.run <hydra overrides>` on every rank of the job.

Started by `hpc-tba train` (mpiexec) or by `srun --mpi=pmi2` under Slurm. Composes the config,
learns this rank's role from the topology, builds it, runs it, closes it in `finally`.
"""
from __future__ import annotations

import os
import sys
import traceback


def run_rank(overrides: list[str]) -> dict | None:
    from hpc_tba.config import compose, to_yaml
    from hpc_tba.roles import build

    cfg = compose(overrides)
    transport, topo, role = build.transport_and_topology(cfg)
    if transport.rank == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
    worker = None
    try:
        worker = build.role(cfg, transport, topo, role)
        summary = worker.run()
    finally:
        if worker is not None:
            worker.close()
    if (transport.rank == 0 and summary is not None and summary.get("preempted")
            and os.environ.get("SLURM_JOB_ID")):
        from hpc_tba.launcher.slurm import preemption_signals, requeue

        if summary.get("signal") not in preemption_signals():
            return summary  # SIGTERM: scancel or the time limit, not a preemption notice

        print(f"hpc-tba: checkpointed at step {summary['steps']}; requeueing Slurm job "
              f"{os.environ['SLURM_JOB_ID']}", flush=True)
        requeue()
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        summary = run_rank(argv)
    except Exception as e:  # one rank failing must end the whole job, not hang the others
        from hpc_tba.config import ConfigError

        rank = os.environ.get("PMI_RANK", os.environ.get("SLURM_PROCID", "?"))
        if isinstance(e, ConfigError):
            print(f"hpc-tba: {e}", file=sys.stderr)
        else:
            traceback.print_exc()
            print(f"hpc-tba: rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        try:
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_size() > 1:
                MPI.COMM_WORLD.Abort(1)
        except ImportError:
            pass
        return 1
    if summary is not None:
        from hpc_tba.roles.report import print_summary

        print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
