"""The sbatch scripts and srun lines that start a run's ranks on Slurm (the command line's side).

Job life cycle (the submitit protocol, without submitit):
  sbatch slurm/<name>.sh  ->  srun --mpi=pmi2 places ranks by the topology (arbitrary distribution
  from a host file)  ->  every rank runs `python -m hpc_tba.cli.rank <overrides>`  ->  `--signal=USR1@g`
  reaches every rank g seconds before the time limit  ->  the handler only sets a flag
  (hpc_tba/launcher/slurm.py)  ->  roles see it at a step boundary, checkpoint, and rank 0 calls
  `requeue()`  ->  Slurm restarts the same job id (SLURM_RESTART_COUNT + 1) on the same run
  directory, which resumes from the checkpoint.

`python -m hpc_tba.cli.scripts sbatch <overrides>` prints a script; `... write-scripts`
regenerates slurm/*.sh (a test checks they equal the generator's output).
"""
from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hpc_tba.config.topology import LayoutError, Topology
from hpc_tba.launcher.local import rank_command

if TYPE_CHECKING:
    from hpc_tba.config import RunConfig


# ---- CPUs per task ---------------------------------------------------------------------------
def role_cpus(cfg: RunConfig) -> dict[str, int]:
    """CPUs each role's task needs: a learner its threads (one process); a searcher its own
    threads plus, for an out-of-process engine (always with tensor parallelism), one share of
    cluster.engine_threads per engine process: the engine core and each TP worker, every one of
    which keeps a core busy polling."""
    c, s = cfg.cluster, cfg.searcher
    engine_procs = 1 + s.tensor_parallel_size if s.engine_process else 0
    return {"learner": c.threads_per_rank, "searcher": c.threads_per_rank + engine_procs * c.engine_threads}


def cpus_per_task(cfg: RunConfig) -> int:
    """--cpus-per-task of the job step. One srun step gives every task the same CPUs, so this is
    the larger of the roles' needs (a TP searcher's); checked against cluster.cpus_per_node."""
    c, topo, need = cfg.cluster, Topology.for_run(cfg), role_cpus(cfg)
    cpus = max(need.values()) if topo.num_searchers else need["learner"]
    if c.cpus_per_node and max(topo.tasks_per_node) * cpus > c.cpus_per_node:
        raise LayoutError(
            f"{max(topo.tasks_per_node)} tasks x {cpus} CPUs (learner {need['learner']}, searcher "
            f"{need['searcher']}: cluster.threads_per_rank + (1 + TP) x cluster.engine_threads) "
            f"exceed cluster.cpus_per_node={c.cpus_per_node}: lower cluster.threads_per_rank")
    return cpus


# ---- command lines and sbatch text -----------------------------------------------------------
def srun_command(cfg: RunConfig, overrides: Sequence[str], *, python: str = "python",
                 extra_args: Sequence[str] = ()) -> list[str]:
    """srun line that starts every rank of `cfg` on the entry point (inside an allocation).

    Ranks are placed by the host file in SLURM_HOSTFILE (see `hostfile_lines`), because learner
    nodes and searcher nodes run different numbers of tasks.
    """
    c = cfg.cluster
    return ["srun", f"--mpi={c.mpi}", "--distribution=arbitrary",
            f"--ntasks={c.world_size}", f"--cpus-per-task={cpus_per_task(cfg)}",
            "--kill-on-bad-exit=1", *extra_args, *rank_command(overrides, python=python)]


def hostfile_lines(topology: Topology, hosts: Sequence[str]) -> list[str]:
    """One host per rank, in rank order: what srun --distribution=arbitrary reads."""
    if len(hosts) < topology.num_nodes:
        raise LayoutError(f"the allocation has {len(hosts)} nodes, the layout needs "
                          f"{topology.num_nodes}")
    return [hosts[topology.node_of(r)] for r in range(topology.world_size)]


def _plans_host_staging(cfg: RunConfig) -> bool:
    """Whether whole weight versions wait in host memory: the searchers' staging=host, or auto with
    between-rounds updates (auto resolves to host when a version does not fit beside vLLM on the
    GPU, as `hpc-tba plan` prints; in-flight updates stream instead); or out-of-process engines,
    whose feeds read `learner.sync_versions_held` copies on learner rank 0's node."""
    s = cfg.searcher
    return cfg.cluster.num_searchers > 0 and (
        s.staging == "host" or (s.staging == "auto" and s.update != "in_flight") or s.engine_process)


def sbatch_header(cfg: RunConfig, name: str) -> list[str]:
    """#SBATCH lines for a config: nodes, tasks, GPUs, time, USR1 grace, requeue."""
    c, topo = cfg.cluster, Topology.for_run(cfg)
    lines = [f"--job-name={name}", f"--nodes={c.nodes}",
             f"--ntasks-per-node={max(topo.tasks_per_node)}",
             f"--cpus-per-task={cpus_per_task(cfg)}"]
    if c.gpus_per_node:
        lines.append(f"--gpus-per-node={c.gpus_per_node}")
    if _plans_host_staging(cfg):
        lines.append("--mem=0")  # whole versions in host memory (searchers' staging, feeds' held copies)
    lines += [f"--time={c.time}", f"--signal=USR1@{c.signal_grace_s}"]
    lines.append("--requeue" if c.requeue else "--no-requeue")
    lines += ["--open-mode=append", "--output=%x-%j.out"]
    if c.exclusive:
        lines.append("--exclusive")
    if c.partition:
        lines.append(f"--partition={c.partition}")
    if c.account:
        lines.append(f"--account={c.account}")
    return [f"#SBATCH {line}" for line in lines]


def env_exports(cfg: RunConfig) -> list[str]:
    """`export` lines every rank's environment needs (threads, DeepSpeed ops, NCCL, cluster.env)."""
    c = cfg.cluster
    threads = str(c.threads_per_rank)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false",
           # DeepSpeed's compiled ops, built once by tools/install.sh, shared by every rank.
           "TORCH_EXTENSIONS_DIR": "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/hpc_tba/torch_extensions}"}
    if not c.gpus_per_node:
        env["DS_ACCELERATOR"] = "cpu"
    if c.gpus_per_node:
        # NCCL: surface errors instead of hanging on them; let a site pin interfaces in cluster.env.
        # No CUDA_DEVICE_MAX_CONNECTIONS=1: that is Megatron-LM's requirement (its TP/SP overlap relies
        # on kernels launching in one hardware queue); nothing here uses Megatron's kernels, and one
        # queue would put ZeRO-3's prefetch all-gathers (their own stream) behind the compute kernels.
        env |= {"NCCL_DEBUG": "${NCCL_DEBUG:-WARN}", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    env |= dict(sorted(c.env.items()))
    return [f'export {k}="{v}"' for k, v in env.items()]


def _layout_comment(cfg: RunConfig) -> str:
    c, topo = cfg.cluster, Topology.for_run(cfg)
    unit = f"{c.gpus_per_node} GPUs" if c.gpus_per_node else f"{c.ranks_per_node or 'all'} rank slots"
    need = role_cpus(cfg)
    procs = (need["searcher"] - c.threads_per_rank) // c.engine_threads
    return (f"# Layout (hpc_tba.config.topology): {c.nodes} nodes x {unit}; {c.num_learners} learner ranks "
            f"on {topo.learner_nodes} node(s), {c.num_searchers} searcher engine(s) "
            f"x TP {topo.tp_size} on {topo.searcher_nodes} node(s).\n"
            f"# CPUs per task: {cpus_per_task(cfg)} (learner {need['learner']}; searcher "
            f"{need['searcher']} = {c.threads_per_rank} + {procs} engine processes x {c.engine_threads}); "
            f"OMP_NUM_THREADS={c.threads_per_rank} per rank, {c.engine_threads} per engine process.")


def _sh(arg: str) -> str:
    """Shell-quote an argument, leaving $VARS expandable."""
    return f'"{arg}"' if "$" in arg else shlex.quote(arg)


def doctor_command(cfg: RunConfig, overrides: Sequence[str], *, python: str = "python") -> list[str]:
    """srun line of the preflight (hpc_tba.cli.doctor): one task on every node of the job."""
    c = cfg.cluster
    return ["srun", f"--mpi={c.mpi}", f"--nodes={c.nodes}", f"--ntasks={c.nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={cpus_per_task(cfg)}", "--kill-on-bad-exit=1",
            python, "-m", "hpc_tba.cli.doctor", "--shared", "$SHARED", *overrides]


PMI2_MISREAD = "mpi/pmi2: invalid client request"
"""What Slurm's pmi2 plugin prints when it split one of MPICH's PMI-1 requests (see STEP_FUNCTION)."""
PMI2_WATCH_S = 600
"""How long step() watches a pmi2 step's output for PMI2_MISREAD (the ranks' MPI_Init is over by then)."""

STEP_FUNCTION = f"""\
# step: run one srun job step; under --mpi=pmi2, start it again (at most twice) when MPI_Init
# failed in Slurm's pmi2 plugin. That plugin reads a PMI-1 request with one read of 1,024 bytes,
# and MPICH's address exchange at MPI_Init puts lines of up to ~1,080 bytes (511 bytes of a
# 4,096-byte buffer per line, in hex with runs of zeros folded, so the length depends on the
# bytes: most starts fit, a few do not). The split request reads as
# "{PMI2_MISREAD}"; the rank that sent it dies or hangs and the
# others wait in MPI_Init, so the step is ended as soon as those words show (they can only come
# while ranks start: watched for {PMI2_WATCH_S} s) and started again. No rank has done work by
# then. Any other failure ends the job with the step's exit code.
step() {{
  local log rc attempt pid t pmi2=0
  [[ "$1 $2" == "srun --mpi=pmi2" ]] && pmi2=1
  log="$(mktemp)"
  for attempt in 1 2 3; do
    : > "$log"
    "$@" > >(tee -a "$log") 2>&1 &
    pid=$!
    if ((pmi2)); then
      for ((t = 0; t < {PMI2_WATCH_S}; t++)); do
        kill -0 "$pid" 2>/dev/null || break
        if grep -q "{PMI2_MISREAD}" "$log"; then kill -TERM "$pid"; break; fi
        sleep 1
      done
    fi
    rc=0
    wait "$pid" || rc=$?
    if ((rc == 0)); then rm -f "$log"; return 0; fi
    if ((!pmi2 || attempt == 3)) || ! grep -q "{PMI2_MISREAD}" "$log"; then
      rm -f "$log"
      return "$rc"
    fi
    echo "hpc_tba: MPI_Init failed in Slurm's pmi2 plugin (a split request); starting it again ($attempt of 2)" >&2
  done
}}"""


def _step_line(cmd: Sequence[str], cut_at: str) -> str:
    """A script line running `cmd` through step(), broken before the Python command."""
    cut = list(cmd).index(cut_at)
    return ("step " + " ".join(_sh(a) for a in cmd[:cut]) + " \\\n  "
            + " ".join(_sh(a) for a in cmd[cut:]) + ' "$@"')


def doctor_lines(cfg: RunConfig, overrides: Sequence[str]) -> list[str]:
    """The script's preflight: `hpc-tba doctor` on every node before any rank starts."""
    cmd = doctor_command(cfg, [*overrides, "run_dir=$RUN_DIR"], python="$PYTHON")
    return ["# Preflight on every node before any rank starts (hpc-tba doctor: GPUs, packages, network,",
            "# shared and staging space, /dev/shm, host memory against the plan, a cross-node all-reduce).",
            "# A problem is one line each and the job stops here; the report is $RUN_DIR/doctor.txt.",
            _step_line(cmd, "$PYTHON")]


def sbatch_script(cfg: RunConfig, overrides: Sequence[str], *, name: str) -> str:
    """The full sbatch script for a config composed from `overrides` (golden-tested)."""
    c, topo = cfg.cluster, Topology.for_run(cfg)
    srun_text = _step_line(srun_command(cfg, [*overrides, "run_dir=$RUN_DIR"], python="$PYTHON"),
                           "$PYTHON")
    preset = " ".join(overrides)
    head = [
        "#!/bin/bash",
        f"# {name}: generated by `python -m hpc_tba.cli.scripts` from `{preset}`.",
        "# Do not edit by hand: change the config, regenerate (tests check the two agree).",
        f"#   sbatch slurm/{name}.sh [hydra overrides for the run, e.g. learner.lr=1e-6]",
        "# Overrides that change the layout need a regenerated script:",
        f"#   python -m hpc_tba.cli.scripts sbatch {preset} cluster.nodes=... > my.sh",
        _layout_comment(cfg),
        *sbatch_header(cfg, name),
        "set -euo pipefail",
    ]
    setup = [c.setup.rstrip()] if c.setup.strip() else []
    body = [
        "",
        "# Run directory on the shared filesystem. A requeued job keeps its job id, so it finds",
        "# its checkpoint, buffer segments and TensorBoard events here and resumes.",
        'SHARED="${HPC_TBA_SHARED:-' + (c.shared_dir or "$SLURM_SUBMIT_DIR") + '}"',
        f'RUN_DIR="${{HPC_TBA_RUN_DIR:-$SHARED/runs/{name}-$SLURM_JOB_ID}}"',
        'PYTHON="${HPC_TBA_PYTHON:-python}"',
        *setup,
        "# torch.distributed rendezvous needs no MASTER_ADDR: rank 0 broadcasts it over MPI.",
        *env_exports(cfg),
        "",
        STEP_FUNCTION,
        "",
        *doctor_lines(cfg, overrides),
        'mkdir -p "$RUN_DIR"',
        "",
        "# Rank placement: node i runs TASKS[i] ranks (learners fill whole nodes first).",
        f"TASKS=({' '.join(str(t) for t in topo.tasks_per_node)})",
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'export SLURM_HOSTFILE="$RUN_DIR/hostfile"',
        'for i in "${!TASKS[@]}"; do',
        '  for ((t = 0; t < TASKS[i]; t++)); do echo "${HOSTS[i]}"; done',
        'done > "$SLURM_HOSTFILE"',
        "",
        f'echo "{name}: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}} on '
        '$SLURM_JOB_NODELIST; tensorboard --logdir $RUN_DIR"',
        *(smoke_lines(cfg, overrides, srun_text) if c.smoke_preempt_step else [srun_text]),
    ]
    return "\n".join(head + body) + "\n"


def smoke_lines(cfg: RunConfig, overrides: Sequence[str], srun_text: str) -> list[str]:
    """A smoke job's run (cluster.smoke_preempt_step): one preemption on the first start, then
    the verdict (hpc_tba.cli.smoke), which only the run that finished reaches."""
    at = cfg.cluster.smoke_preempt_step
    verdict = " ".join(_sh(a) for a in ["$PYTHON", "-m", "hpc_tba.cli.smoke", "verdict", "$RUN_DIR",
                                        *overrides])
    return [f"# Smoke job: on the first start, USR1 to every rank once the learner logged step {at}",
            "# (what --signal=USR1@grace sends): every role checkpoints, rank 0 requeues the job, and",
            "# this script starts again as restart 1, which resumes from that checkpoint.",
            'if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then',
            f'  "$PYTHON" -m hpc_tba.cli.smoke preempt "$RUN_DIR" {at} &',
            "  PREEMPT=$!",
            "fi",
            srun_text,
            'kill ${PREEMPT:-} 2>/dev/null || true',
            "# One line, PASS or FAIL, with the sync time, step time and peak memory per GPU beside the plan's.",
            verdict + ' "$@"']
