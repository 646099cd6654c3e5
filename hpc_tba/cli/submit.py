"""`hpc_tba.launch(cfg)`: submit a run through submitit, on Slurm or on this machine.

Why submitit as well as sbatch scripts: Python users (sweeps, notebooks) get a `Job` handle with
`.result()`, `.cancel()` and logs, and submitit's preemption protocol. The ranks, their topology
and the entry point are the same as `sbatch slurm/<name>.sh`:

- executor="slurm": one submitit task per rank, started by `srun --mpi=<cluster.mpi>`, placed by
  the same host file as the sbatch scripts, each calling `hpc_tba.cli.rank.main(overrides)`.
- executor="local": one submitit task on this machine that runs `mpiexec -n <world>` of
  `python -m hpc_tba.cli.rank`, exactly what `hpc-tba train` runs (launcher/local.py).

Preemption: submitit delivers its signal (USR2) to every task; `install_preemption_handler` in
hpc_tba.launcher.slurm routes it, like Slurm's USR1, to the flag the roles check, so every role
checkpoints and rank 0 requeues; the requeued job re-runs `RankEntry`, which resumes from the run
directory. `RankEntry.checkpoint` is submitit's fallback when the run has no handler installed.
"""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import submitit

    from hpc_tba.config import RunConfig


class RankEntry:
    """The callable submitit pickles: one MPI rank of the run (Slurm executor)."""

    def __init__(self, overrides: Sequence[str]) -> None:
        self.overrides = list(overrides)

    def __call__(self) -> int:
        from hpc_tba.cli.rank import main

        rc = main(self.overrides)
        if rc:
            raise RuntimeError(f"hpc_tba.cli.rank exited with {rc} (see this task's log)")
        return rc

    def checkpoint(self) -> Any:
        """Requeue the same ranks: the state lives in the run directory, not in this object."""
        import submitit

        return submitit.helpers.DelayedSubmission(RankEntry(self.overrides))


class LocalEntry:
    """The callable for the local executor: mpiexec of every rank on this machine."""

    def __init__(self, overrides: Sequence[str], world_size: int, threads: int,
                 mpiexec: str) -> None:
        self.overrides, self.world_size = list(overrides), world_size
        self.threads, self.mpiexec = threads, mpiexec

    def __call__(self) -> int:
        from hpc_tba.launcher.local import find_mpiexec, mpiexec_launch

        mpiexec = find_mpiexec(self.mpiexec)
        if mpiexec is None:
            raise RuntimeError(f"MPI launcher {self.mpiexec!r} not found")
        cmd, env = mpiexec_launch(mpiexec, self.world_size, self.overrides, self.threads)
        rc = subprocess.call(cmd, env=env)
        if rc:
            raise RuntimeError(f"{' '.join(cmd)} exited with {rc}")
        return rc


def _run_overrides(cfg: RunConfig, overrides: Sequence[str] | None) -> list[str]:
    """The overrides every rank composes: the caller's, pinned to this run directory."""
    if overrides is None:
        overrides = config_overrides(cfg)
    return [o for o in overrides if not o.startswith("run_dir=")] + [f"run_dir={cfg.run_dir}"]


def config_overrides(cfg: RunConfig) -> list[str]:
    """Hydra overrides that recreate `cfg` from the default composition (checked round trip).

    Used when `launch` is given only a RunConfig: ranks compose their config from overrides.
    """
    from omegaconf import OmegaConf

    from hpc_tba.assembly.compose import compose

    # Another objective has other fields: select its yaml first, then override from there.
    lead = [] if cfg.algo.name == compose([]).algo.name else [f"algo={cfg.algo.name}"]
    base = OmegaConf.to_container(OmegaConf.structured(compose(lead)))
    want = OmegaConf.to_container(OmegaConf.structured(cfg))
    out: list[str] = list(lead)

    def walk(prefix: str, a: Any, b: Any) -> None:
        if isinstance(b, dict) and isinstance(a, dict):
            for k, v in b.items():
                if k in a:
                    walk(f"{prefix}{k}.", a[k], v)
                else:  # a key the defaults lack (cluster.env): Hydra's append syntax
                    out.append(f"+{prefix}{k}={_hydra_value(v)}")
        elif a != b:
            out.append(f"{prefix[:-1]}={_hydra_value(b)}")

    walk("", base, want)
    # The default run_dir may be derived (e.g. a timestamp): always pin this run's.
    out = [o for o in out if not o.startswith("run_dir=")] + [f"run_dir={_hydra_value(cfg.run_dir)}"]
    if compose(out) != cfg:
        raise ValueError("this RunConfig cannot be expressed as overrides; pass overrides=[...] "
                         "(the ones it was composed from) to launch()")
    return out


def _hydra_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, str):
        # Hydra quoting: a backslash is literal unless it precedes a quote or ends the string.
        v = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", v)
        v = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, v)
        return f"'{v}'"
    return repr(v)


def _slurm_parameters(cfg: RunConfig) -> dict[str, Any]:
    """submitit SlurmExecutor parameters mirroring the #SBATCH lines of `sbatch_script`."""
    from hpc_tba.cli import sbatch
    from hpc_tba.config.topology import Topology

    c, topo = cfg.cluster, Topology.for_run(cfg)
    hosts = ('mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST"); '
             f"TASKS=({' '.join(map(str, topo.tasks_per_node))}); "
             f'export SLURM_HOSTFILE="{cfg.run_dir}/hostfile"; mkdir -p "{cfg.run_dir}"; '
             'for i in "${!TASKS[@]}"; do for ((t = 0; t < TASKS[i]; t++)); do '
             'echo "${HOSTS[i]}"; done; done > "$SLURM_HOSTFILE"')
    env = sbatch.env_exports(cfg)
    params: dict[str, Any] = dict(
        job_name=cfg.name, nodes=c.nodes, ntasks_per_node=max(topo.tasks_per_node),
        cpus_per_task=sbatch.cpus_per_task(cfg), time=_minutes(c.time), signal_delay_s=c.signal_grace_s,
        srun_args=[f"--mpi={c.mpi}", "--distribution=arbitrary", f"--ntasks={c.world_size}"],
        setup=[*([c.setup] if c.setup.strip() else []), *env, hosts])
    if c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    if c.partition:
        params["partition"] = c.partition
    if c.account:
        params["account"] = c.account
    if c.exclusive:
        params["exclusive"] = True
    return params


def _minutes(time_str: str) -> int:
    """Slurm --time text to whole minutes (submitit's unit)."""
    days, _, rest = time_str.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        h, m = (parts + [0, 0])[:2]
        return int(days) * 1440 + h * 60 + m
    if len(parts) == 3:
        return parts[0] * 60 + parts[1] + (parts[2] > 0)
    return parts[0] + (len(parts) == 2 and parts[1] > 0)


def _rank_executor_class() -> type:
    import submitit

    class RankExecutor(submitit.SlurmExecutor):
        """SlurmExecutor whose job has one task per rank, not nodes x ntasks_per_node.

        Learner and searcher nodes run different numbers of ranks, so the allocation's task
        slots can exceed the ranks srun starts; submitit must wait for the ranks' results only.
        """

        world_size = 1

        def _num_tasks(self) -> int:
            return self.world_size

    return RankExecutor


def _RankExecutor(**kw: Any) -> Any:  # noqa: N802 - a factory standing in for the class
    return _rank_executor_class()(**kw)


def launch(cfg: RunConfig, *, executor: str | None = None, folder: str | os.PathLike | None = None,
           overrides: Sequence[str] | None = None) -> submitit.Job:
    """Submit the run `cfg` and return its submitit Job.

    executor: "slurm" or "local" (default: cluster.backend). folder: submitit's logs and pickles
    (default: <run_dir>/submitit). overrides: the Hydra overrides `cfg` came from, if known.
    """
    import submitit

    executor = executor or cfg.cluster.backend
    folder = Path(folder or Path(cfg.run_dir) / "submitit")
    ranks = _run_overrides(cfg, overrides)
    if executor == "slurm":
        from hpc_tba.config.topology import Topology
        from hpc_tba.plan.planner import check_grace

        Topology.for_run(cfg)  # refuse an impossible layout before queueing anything
        check_grace(cfg)  # and a USR1 grace too short for the final checkpoint
        ex = _RankExecutor(folder=folder, max_num_timeout=3)
        ex.world_size = cfg.cluster.world_size
        ex.update_parameters(**_slurm_parameters(cfg))
        return ex.submit(RankEntry(ranks))
    if executor == "local":
        from hpc_tba.tasks.embedded import resolve_model_path

        resolve_model_path(cfg.model, cfg.task)  # build the model once, not on every rank
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=_minutes(cfg.cluster.time), nodes=1, tasks_per_node=1)
        c = cfg.cluster
        return ex.submit(LocalEntry(ranks, c.world_size, c.threads_per_rank, c.mpiexec))
    raise ValueError(f"executor={executor!r}: use 'slurm' or 'local'")
