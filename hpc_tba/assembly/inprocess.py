"""The whole loop in ONE process: every rank a thread with its own in-process transport endpoint.

    python -m hpc_tba.assembly.inprocess <hydra overrides>     # e.g. learner.total_steps=4

For debugging (one process: one debugger, one py-spy, breakpoints in any role) and unit tests.
The roles, the weight sync, the buffer and the engines are the real ones, built by the same
function as under mpiexec (hpc_tba.assembly.build.build_role, after the same
hpc_tba.assembly.rank.setup_rank); only the message transport is
hpc_tba.comm.inprocess instead of MPI. What one process allows, and how each is handled:

- One learner only: DeepSpeed runs ZeRO-3 on torch.distributed's default process group, and a
  process has one. `cluster.num_learners > 1` is refused before anything is built.
- The weight-sync group is the usual standalone gloo group on a TCPStore: learner rank 0's thread
  holds one end, each searcher's thread its own (their blocking calls release the GIL).
- gloo only: NCCL refuses two ranks of one group on one GPU, so `cluster.dist_backend` must be
  gloo (or auto on a machine without CUDA).
- Signal handlers can only be installed by the main thread: it installs them once and every rank
  shares the flag (SIGUSR1/SIGTERM checkpoint and stop the run, as under mpiexec).
- One in-process vLLM engine: its world group of one reuses the learner's default group of one,
  but vLLM keeps its parallel groups in process-wide state, so a second engine in the same
  process fails ("... group is already initialized"). More than one searcher therefore needs
  `searcher.engine_process=true` (each engine in a child process of its own, as it can be under
  mpiexec); `cluster.num_searchers > 1` without it is refused.
- Building a model changes process-wide state (DeepSpeed's zero.Init patches every module's
  construction; transformers and vLLM set torch's default dtype), so every model is built under
  hpc_tba.models.construction's lock: the roles' threads build one model at a time (the same
  code under mpiexec, where the lock is never contended). Engines in child processes start one
  after another here.
- A rank that fails aborts the in-process job: the others stop at their next transport call
  (`TransportAborted`), and the first failure is raised from `run_in_process`.

Roles share one Python interpreter (the GIL) and `cluster.threads_per_rank` torch threads in
all: slower than mpiexec, never a throughput measurement.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from hpc_tba.comm.inprocess import InProcessNetwork, TransportAborted
from hpc_tba.comm.transport import Transport

JOIN_POLL_S = 0.2
ABORT_GRACE_S = 30.0
"""After a rank failed, how long the others may take to notice the abort before the run gives
up on them (a rank blocked inside a torch.distributed call never looks at the transport)."""


class InProcessError(RuntimeError):
    """The configuration cannot run in one process."""


def check_config(cfg) -> None:
    """Refuse what one process cannot hold, naming the setting and the reason."""
    if cfg.cluster.num_learners != 1:
        raise InProcessError(
            f"cluster.num_learners={cfg.cluster.num_learners}: an in-process run holds one learner "
            "(DeepSpeed's ZeRO-3 group is torch.distributed's default group, one per process); "
            "use hpc-tba train for more")
    from hpc_tba.comm.groups import resolve_backend

    if cfg.cluster.num_searchers > 1 and not cfg.searcher.engine_process:
        raise InProcessError(
            f"cluster.num_searchers={cfg.cluster.num_searchers} with in-process engines: vLLM keeps "
            "its parallel groups in process-wide state, one engine per process; set "
            "searcher.engine_process=true (each engine in a child process) or cluster.num_searchers=1")
    if resolve_backend(cfg.cluster.dist_backend) != "gloo":
        raise InProcessError(
            f"cluster.dist_backend={cfg.cluster.dist_backend} resolves to nccl: an in-process run "
            "needs gloo (NCCL refuses two ranks of the weight-sync group on one GPU); set "
            "cluster.dist_backend=gloo")


def run_ranks(size: int, make_role: Callable[[Transport], object], *, timeout_s: float = 1800.0,
              abort_grace_s: float = ABORT_GRACE_S) -> list:
    """Run `size` ranks as threads: each builds its role with `make_role(endpoint)`, runs it and
    closes it; returns each rank's `run()` result. The first failure aborts the others and is
    raised here (KeyboardInterrupt in the main thread too); ranks still running `abort_grace_s`
    after it are left behind (daemon threads: they end with the process)."""
    net = InProcessNetwork(size, timeout_s=timeout_s)
    results: list = [None] * size
    errors: list[tuple[int, BaseException]] = []

    def rank(r: int) -> None:
        worker = None
        try:
            worker = make_role(net.endpoint(r))
            results[r] = worker.run()
        except BaseException as e:
            if not isinstance(e, TransportAborted) or not errors:
                errors.append((r, e))
            net.abort(1)
        finally:
            if worker is not None:
                try:
                    worker.close()
                except Exception as e:  # a role that cannot close must not hide the first error
                    errors.append((r, e))

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}", daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    deadline = None
    try:
        while any(t.is_alive() for t in threads) and (deadline is None or time.time() < deadline):
            for t in threads:  # short joins: the main thread stays responsive to Ctrl-C
                t.join(JOIN_POLL_S / size)
            if errors and deadline is None:
                deadline = time.time() + abort_grace_s
    except KeyboardInterrupt:
        net.abort(130)
        raise
    stuck = [t.name for t in threads if t.is_alive()]
    first = next(((r, e) for r, e in errors if not isinstance(e, TransportAborted)), errors[0] if errors else None)
    if first is not None:
        r, e = first
        left = f" ({', '.join(stuck)} still blocked {abort_grace_s:.0f} s later, left behind)" if stuck else ""
        raise RuntimeError(f"in-process rank {r} failed: {type(e).__name__}: {e}{left}") from e
    return results


def run_in_process(cfg) -> dict:
    """Train with every rank of `cfg` a thread of this process; returns the learner's summary
    (what `hpc-tba train` prints and writes to <run_dir>/summary.json)."""

    from hpc_tba.assembly.build import build_role
    from hpc_tba.assembly.compose import write_run_config
    from hpc_tba.assembly.rank import install_run_signals, setup_rank
    from hpc_tba.config.topology import Topology
    from hpc_tba.launcher.slurm import PreemptionFlag

    check_config(cfg)
    topo = Topology.for_run(cfg, cfg.cluster.num_learners + cfg.cluster.num_searchers)
    write_run_config(cfg)
    # One flag for every rank: only the main thread may install signal handlers (off it, the
    # signals stay as they are and the flag is never set).
    preemption = PreemptionFlag()
    if threading.current_thread() is threading.main_thread():
        preemption = install_run_signals()

    def make_role(transport: Transport):
        return build_role(cfg, setup_rank(cfg, transport, preemption=preemption))

    return run_ranks(topo.world_size, make_role)[0]


def main(argv: list[str] | None = None) -> int:
    from hpc_tba.assembly.compose import compose
    from hpc_tba.config import ConfigError
    from hpc_tba.roles.report import print_summary

    try:
        cfg = compose(sys.argv[1:] if argv is None else argv)
        check_config(cfg)
    except (ConfigError, InProcessError) as e:
        print(f"hpc-tba: {e}", file=sys.stderr)
        return 2
    print_summary(run_in_process(cfg))
    print(f"run directory        {cfg.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
