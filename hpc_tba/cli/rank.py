"""Per-rank entry point: `python -m hpc_tba.cli.rank <hydra overrides>` on every rank of the job.

Started by `hpc-tba train` (mpiexec) or by `srun --mpi=pmi2` under Slurm. Composes the config,
gives the process its GPUs (hpc_tba.assembly.rank.place_devices, before mpi4py is imported: a
CUDA-aware MPI initialises CUDA in MPI_Init), starts MPI, sends this rank's third-party output to
`<run_dir>/logs/rank<N>.log` (hpc_tba.launcher.console), sets the rank up (hpc_tba.assembly.rank: the
transport, the layout, pinning, signals), builds its role (hpc_tba.assembly.build), runs it,
closes it in `finally`. Learner rank 0 prints the one summary and draws `<run_dir>/report.png`.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import NoReturn


def run_rank(cfg) -> tuple[int, dict | None]:
    """(this rank, its role's summary: a dict on learner ranks, None on searchers)."""
    from hpc_tba.assembly.build import build_role
    from hpc_tba.assembly.compose import write_run_config
    from hpc_tba.assembly.rank import setup_rank
    from hpc_tba.launcher.console import say

    rank = setup_rank(cfg)
    transport, topo = rank.transport, rank.topology
    if transport.rank == 0:
        write_run_config(cfg)
        say(f"hpc-tba: building {topo.num_learners} ZeRO-3 learner(s) and {topo.num_searchers} "
            f"vLLM searcher(s); TensorBoard: tensorboard --logdir {cfg.run_dir}/tb")
    worker = None
    try:
        worker = build_role(cfg, rank)
        if transport.rank == 0:
            say("hpc-tba: roles built; training (first the searchers fill the replay buffer)")
        summary = worker.run()
    finally:
        if worker is not None:
            worker.close()
    if (transport.rank == 0 and summary is not None and summary.get("preempted")
            and os.environ.get("SLURM_JOB_ID")):
        from hpc_tba.launcher.slurm import preemption_signals, requeue

        if summary.get("signal") not in preemption_signals():
            return transport.rank, summary  # SIGTERM: scancel or the time limit, not a preemption

        say(f"hpc-tba: checkpointed at step {summary['steps']}; requeueing Slurm job "
            f"{os.environ['SLURM_JOB_ID']}", stream="out")
        requeue()
    return transport.rank, summary


def fail(run_dir: str | None, rank: int, e: BaseException) -> None:
    """Log the whole traceback, record the error, show it once, end every rank of the job."""
    from hpc_tba.launcher.console import LAUNCHER_ENV, failure_line, failures, record_failure, say

    traceback.print_exc()  # into this rank's log
    message = f"{type(e).__name__}: {e}"
    first = record_failure(run_dir, rank, message) if run_dir else True
    # `hpc-tba train` prints the first failure once after the job ended (an MPI abort can cut
    # off what a rank still had in flight to the terminal); a rank started otherwise prints it.
    if first and os.environ.get(LAUNCHER_ENV) != "cli":
        say(failure_line(failures(run_dir)) if run_dir else f"hpc-tba: rank {rank} failed: {message}")
        time.sleep(0.5)  # let srun/mpiexec forward the line before the abort tears the job down
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(1)  # one rank failing must end the whole job, not hang the others
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    from hpc_tba.assembly.compose import compose
    from hpc_tba.config import ConfigError
    from hpc_tba.launcher.console import rank_from_environ, setup_rank_output

    argv = sys.argv[1:] if argv is None else argv
    rank = rank_from_environ()
    try:
        cfg = compose(argv)
    except ConfigError as e:  # before anything is redirected: straight to the terminal
        print(f"hpc-tba: {e}", file=sys.stderr)
        return 2
    from hpc_tba.assembly.rank import check_placed_rank, place_devices
    from hpc_tba.config.topology import LayoutError

    try:
        placed = place_devices(cfg)  # before MPI: CUDA_VISIBLE_DEVICES from the layout
        rank = _init_mpi(rank)
        check_placed_rank(placed, rank)
    except LayoutError as e:
        fail(None, rank, e)
        return 1
    setup_rank_output(cfg.run_dir, rank)
    try:
        rank, summary = run_rank(cfg)
    except Exception as e:
        fail(cfg.run_dir, rank, e)
        return 1
    if summary is not None and rank == 0:
        finish_run(cfg.run_dir, summary)
    return 0


def _init_mpi(rank: int) -> int:
    """Start MPI before the output is redirected, so that a launcher failure inside MPI_Init
    (e.g. Slurm's pmi2 plugin misreading a request) shows where srun's own errors are; returns
    this process's rank in the job."""
    try:
        from mpi4py import MPI
    except ImportError:
        return rank
    return MPI.COMM_WORLD.Get_rank()


def finish_run(run_dir: str, summary: dict) -> None:
    """Learner rank 0 at the end: the summary on the terminal, the report picture on disk."""
    from hpc_tba.launcher.console import say
    from hpc_tba.roles.report import print_summary

    try:
        from hpc_tba.cli.report import draw_report

        path = draw_report([run_dir], os.path.join(run_dir, "report.png"))
    except Exception as e:  # a picture that cannot be drawn must not fail a finished run
        traceback.print_exc()
        path = None
        say(f"hpc-tba: could not draw report.png ({type(e).__name__}: {e})")
    print_summary(summary, run_dir=run_dir, report=path)


def exit_process(code: int) -> NoReturn:
    """End a rank's process now that its work is done, skipping Python's own teardown.

    The rank's threads that are not daemons are joined, every exit handler runs (logging's,
    vLLM's) and MPI is finalized, as at a normal exit; what is skipped is the interpreter's
    teardown of its modules and their final garbage collections over the heap that vLLM,
    transformers and DeepSpeed leave behind: ~3 s of every rank's exit here, measured on 2 cores
    (after importing vLLM and DeepSpeed: 3.3 s to leave normally, 0.5 s this way)."""
    import atexit
    import threading

    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # what CPython's exit runs (no public name for it)
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")  # mpi4py finalizes in a C-level exit hook, after teardown
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # also lets the launcher forward this rank's last lines before it ends
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
