"""`hpc-tba`: train (the embedded default with no arguments), plan, eval, report, status.

    hpc-tba train [-v] [hydra overrides]  # 1 learner + 2 searchers on this machine via mpiexec
    hpc-tba plan +experiment=tba_70b      # layout and per-GPU memory before queueing a job
    hpc-tba report RUN_DIR [RUN_DIR ...]  # draw report.png again, or overlay several runs
    hpc-tba status RUN_DIR                # step, version, buffer, checkpoint, pass@1 of a run
    hpc-tba doctor [overrides]            # preflight of this node (every node, first, in sbatch)
    hpc-tba data {show,hh-rlhf,tldr} ...  # look at / convert a downloaded data set (data_cli)

The terminal shows our own lines only; every rank's third-party output is in
`<run_dir>/logs/rank<N>.log` (`-v` / HPC_TBA_VERBOSE=1 shows it live too; hpc_tba.launcher.console).
"""
from __future__ import annotations

import os
import subprocess
import sys

USAGE = "usage: hpc-tba {train,plan,doctor,eval,preprocess,report,status,data} [-v] [hydra overrides ...]"


def train(overrides: list[str], *, verbose: bool = False) -> int:
    from hpc_tba.assembly.compose import compose
    from hpc_tba.launcher.console import LAUNCHER_ENV, VERBOSE_ENV, captured, log_dir
    from hpc_tba.launcher.local import find_mpiexec, mpiexec_launch

    cfg = compose(overrides)  # a bad setting is refused here, before torch is imported (seconds)
    check_data(cfg.task, required=cfg.cluster.backend == "local")
    if cfg.cluster.backend != "local":
        from hpc_tba.cli import submit

        job = submit.launch(cfg, overrides=overrides)
        print(f"submitted {job}")
        return 0
    from hpc_tba.config.topology import Topology
    from hpc_tba.tasks.embedded import resolve_model_path

    Topology.for_run(cfg)  # refuse an impossible layout before building anything
    mpiexec = find_mpiexec(cfg.cluster.mpiexec)
    if mpiexec is None:
        raise SystemExit(f"hpc-tba: MPI launcher {cfg.cluster.mpiexec!r} not found on PATH "
                         "(install the `mpich` wheel, load your site's MPI module, or set "
                         "cluster.mpiexec=...)")
    if cfg.resume == "never" and os.path.isdir(cfg.run_dir) and os.listdir(cfg.run_dir):
        raise SystemExit(f"hpc-tba: run_dir {cfg.run_dir} already holds a run; choose another "
                         "run_dir=..., remove it, or continue it with resume=auto")
    if cfg.model.path == "embedded":
        print("hpc-tba: preparing the embedded model (built and warm-started once, then cached)",
              file=sys.stderr)
        # The build's library chatter goes to the run's logs like the ranks' (build once here,
        # not on every rank).
        with captured(os.path.join(log_dir(cfg.run_dir), "launcher.log"), verbose=verbose):
            path = resolve_model_path(cfg.model, cfg.task)
        print(f"hpc-tba: model {path}", file=sys.stderr)
    else:
        resolve_model_path(cfg.model, cfg.task)
    print(f"hpc-tba: run directory {cfg.run_dir} (logs of every rank in {log_dir(cfg.run_dir)})",
          file=sys.stderr)
    cmd, env = mpiexec_launch(mpiexec, cfg.cluster.world_size, [*overrides, f"run_dir={cfg.run_dir}"],
                              cfg.cluster.threads_per_rank)
    env[LAUNCHER_ENV] = "cli"
    if verbose:
        env[VERBOSE_ENV] = "1"
    print(f"hpc-tba: starting {cfg.cluster.world_size} ranks with {os.path.basename(mpiexec)}",
          file=sys.stderr, flush=True)
    return job_result(cfg.run_dir, subprocess.call(cmd, env=env))


def check_data(task_cfg, *, required: bool) -> None:
    """Refuse, before any rank starts, a file-backed task whose data lacks its fields or the
    task.columns it maps (first row; tasks.layout.check_columns). A Slurm submission checks only
    data this machine sees (a login node may not mount the compute nodes' paths)."""
    from hpc_tba.tasks.layout import check_columns
    from hpc_tba.tasks.records import DataError

    if not task_cfg.path or (not required and not os.path.exists(task_cfg.path.split("{split}")[0])):
        return
    try:
        check_columns(task_cfg)
    except DataError as e:
        raise SystemExit(f"hpc-tba: {e}") from None


def job_result(run_dir: str, code: int) -> int:
    """The exit status of `hpc-tba train`, after printing a failed rank's error once.

    1 when a rank failed with an error (recorded by hpc_tba.cli.rank), mpiexec's status (128 + the
    signal when it was killed) when the job failed otherwise, 0 when it succeeded."""
    from hpc_tba.launcher.console import failure_line, failures, log_dir

    records = failures(run_dir)
    if records:
        print(failure_line(records), file=sys.stderr, flush=True)
        return 1
    if code != 0:
        code = 128 - code if code < 0 else code
        print(f"hpc-tba: the job ended with exit status {code} without a Python error (a rank "
              f"killed, out of memory?); logs of every rank in {log_dir(run_dir)}", file=sys.stderr)
    return code


def preprocess(overrides: list[str]) -> int:
    """`hpc-tba preprocess task=offline task.path=FILE`: behaviour/reference log-probs and A-LoL
    advantages under the starting policy, written next to the data (see roles/offline.py)."""
    from hpc_tba.assembly.compose import compose
    from hpc_tba.roles.offline import preprocess_file
    from hpc_tba.tasks.embedded import resolve_model_path

    cfg = compose(overrides)
    if cfg.task.name != "offline" or not os.path.isfile(cfg.task.path):
        raise SystemExit("hpc-tba: preprocess needs task=offline task.path=<a JSONL/parquet file>")
    out = preprocess_file(cfg.task.path, resolve_model_path(cfg.model, cfg.task),
                          temperature=cfg.searcher.temperature, task_cfg=cfg.task)
    print(f"hpc-tba: wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from hpc_tba.config import ConfigError
    from hpc_tba.config.topology import LayoutError

    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in ("-v", "--verbose") for a in argv)
    argv = [a for a in argv if a not in ("-v", "--verbose")]
    cmd = argv.pop(0) if argv and not ("=" in argv[0] or argv[0].startswith("+")) else "train"
    try:
        if cmd == "train":
            return train(argv, verbose=verbose)
        if cmd == "report":
            from hpc_tba.cli.report import report_main

            return report_main(argv)
        if cmd == "status":
            from hpc_tba.cli.status import status_main

            return status_main(argv)
        if cmd == "plan":
            from hpc_tba.plan.planner import plan_main

            return plan_main(argv)
        if cmd == "doctor":
            from hpc_tba.cli.doctor import doctor_main

            return doctor_main(argv)
        if cmd == "preprocess":
            return preprocess(argv)
        if cmd == "eval":
            from hpc_tba.cli.eval import eval_main

            return eval_main(argv)
        if cmd == "data":
            from hpc_tba.cli.data import data_main

            return data_main(argv)
    except (ConfigError, LayoutError, FileNotFoundError) as e:
        print(f"hpc-tba: {e}", file=sys.stderr)
        return 2
    print(f"hpc-tba: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
