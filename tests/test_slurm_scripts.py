"""Golden tests of the generated sbatch scripts and srun lines, and the SLURM_* parsing.

slurm/*.sh are checked in; they must equal what the generator emits from their presets, and the
lines a cluster admin reads (#SBATCH, srun) are pinned literally for the 70B and 8B runs.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hpc_tba.assembly.compose import compose
from hpc_tba.cli import sbatch, scripts
from hpc_tba.config.topology import LayoutError, Topology
from hpc_tba.launcher import slurm

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(scripts.PRESETS))
def test_checked_in_scripts_equal_the_generator(name):
    path = REPO / "slurm" / f"{name}.sh"
    assert path.read_text() == scripts.preset_script(name), (
        f"slurm/{name}.sh is stale: run `python -m hpc_tba.cli.scripts write-scripts`")
    assert os.access(path, os.X_OK)


def _lines(text: str, prefix: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


def test_golden_70b():
    text = scripts.preset_script("tba_70b")
    assert _lines(text, "#SBATCH") == [
        "#SBATCH --job-name=tba_70b",
        "#SBATCH --nodes=16",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --cpus-per-task=13",  # a TP-4 searcher: 8 threads + engine core + 4 workers
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --mem=0",  # the feeds' held versions: 262.8 GiB on learner rank 0's node
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --signal=USR1@1500",  # holds a 70B save (hpc-tba plan)
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=%x-%j.out",
        "#SBATCH --exclusive",
    ]
    assert "TASKS=(8 8 8 8 8 8 8 8 2 2 2 2 2 2 2 2)" in text
    assert ("srun --mpi=pmi2 --distribution=arbitrary --ntasks=80 --cpus-per-task=13 "
            "--kill-on-bad-exit=1 \\\n"
            '  "$PYTHON" -m hpc_tba.cli.rank +experiment=tba_70b "run_dir=$RUN_DIR" "$@"\n') in text
    assert 'export TORCH_NCCL_ASYNC_ERROR_HANDLING="1"' in text


def test_the_node_memory_is_asked_for_where_whole_versions_wait_in_host_memory():
    """--mem=0 where the plan holds whole versions in host memory (searchers' host staging, or the
    feeds' held copies for out-of-process engines), and only there."""
    def mem(*overrides):
        return "#SBATCH --mem=0" in sbatch.sbatch_header(compose(["+experiment=tba_8b", *overrides]), "x")

    assert not mem("searcher.update=in_flight")
    assert mem("searcher.update=in_flight", "searcher.engine_process=true")
    assert mem("searcher.update=in_flight", "searcher.staging=host")


def test_golden_8b():
    text = scripts.preset_script("tba_8b")
    assert _lines(text, "#SBATCH --nodes") == ["#SBATCH --nodes=2"]
    assert _lines(text, "#SBATCH --signal") == ["#SBATCH --signal=USR1@300"]
    assert "TASKS=(8 8)" in text
    assert ("srun --mpi=pmi2 --distribution=arbitrary --ntasks=16 --cpus-per-task=8 "
            "--kill-on-bad-exit=1 \\\n"
            '  "$PYTHON" -m hpc_tba.cli.rank +experiment=tba_8b "run_dir=$RUN_DIR" "$@"\n') in text


def test_srun_command_and_site_options():
    cfg = compose(["+experiment=tba_8b", "cluster.partition=gpu", "cluster.account=rl",
                   "cluster.mpi=pmix", "+cluster.env.NCCL_SOCKET_IFNAME=ib0"])
    assert sbatch.srun_command(cfg, ["+experiment=tba_8b"]) == [
        "srun", "--mpi=pmix", "--distribution=arbitrary", "--ntasks=16", "--cpus-per-task=8",
        "--kill-on-bad-exit=1", "python", "-m", "hpc_tba.cli.rank", "+experiment=tba_8b"]
    text = sbatch.sbatch_script(cfg, ["+experiment=tba_8b"], name="x")
    assert "#SBATCH --partition=gpu" in text and "#SBATCH --account=rl" in text
    assert 'export NCCL_SOCKET_IFNAME="ib0"' in text


def test_the_cpu_test_cluster_runs_mpich_over_ofi_tcp():
    # configs/cluster/slurm_cpu.yaml says why: Slurm 22.05's pmi2 plugin splits UCX's long PMI lines.
    text = sbatch.sbatch_script(compose(["cluster=slurm_cpu"]), ["cluster=slurm_cpu"], name="x")
    assert 'export MPIR_CVAR_CH4_NETMOD="ofi"' in text and 'export FI_PROVIDER="tcp"' in text


def test_expand_nodelist():
    assert slurm.expand_nodelist("n[1-3]") == ["n1", "n2", "n3"]
    assert slurm.expand_nodelist("gpu[008-010,012],login1") == [
        "gpu008", "gpu009", "gpu010", "gpu012", "login1"]
    assert slurm.expand_nodelist("a[1-2]-ib,b3") == ["a1-ib", "a2-ib", "b3"]


def test_slurm_env_parsing():
    assert slurm.SlurmEnv.from_environ({}) is None
    env = slurm.SlurmEnv.from_environ({
        "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n2",
        "SLURM_NODEID": "1", "SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0",
        "SLURM_RESTART_COUNT": "1", "SLURM_SUBMIT_DIR": "/w"})
    assert env == slurm.SlurmEnv("42", ("n1", "n2"), "n2", 1, 2, 3, 0, 1, "/w")


def test_check_placement_catches_stale_scripts():
    topo = Topology.for_run(compose(["cluster=slurm_cpu"]))
    env = slurm.SlurmEnv("1", ("n1", "n2", "n3"), "n2", 1, 1, 3, 0, 0, "")
    slurm.check_placement(topo, 1, env)
    with pytest.raises(LayoutError, match="places it on node 2"):
        slurm.check_placement(topo, 2, env)
    with pytest.raises(LayoutError, match="regenerate"):
        slurm.check_placement(topo, 1, slurm.SlurmEnv("1", (), "n2", 1, 1, 5, 0, 0, ""))
    assert sbatch.hostfile_lines(topo, ["a", "b", "c"]) == ["a", "b", "c"]


def test_cuda_visible_devices_follow_the_topology():
    topo = Topology.for_run(compose(["+experiment=tba_70b"]))
    assert slurm.cuda_visible_devices(topo, 3) == "3"
    assert slurm.cuda_visible_devices(topo, 65) == "4,5,6,7"


def test_usr1_sets_the_flag_only():
    old = signal.getsignal(signal.SIGUSR1)
    try:
        flag = slurm.install_preemption_handler()
        assert not flag.is_set()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.wait(5) and flag.signum == signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_requeue_calls_scontrol(tmp_path, monkeypatch):
    log = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    slurm.requeue("77", scontrol=str(fake))
    assert log.read_text() == "requeue 77\n"
    # another rank got there first: the job is already pending again
    fake.write_text('#!/bin/sh\necho "Job is pending execution for job $2" >&2; exit 1\n')
    slurm.requeue("77", scontrol=str(fake))
    fake.write_text('#!/bin/sh\necho "Invalid job id specified" >&2; exit 1\n')
    with pytest.raises(RuntimeError, match="Invalid job id"):
        slurm.requeue("77", scontrol=str(fake))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(RuntimeError, match="outside a Slurm job"):
        slurm.requeue(scontrol=str(fake))


FAKE_SRUN = """#!/bin/bash
# a stand-in srun: fails with the words of line N of $PLAN (one word per attempt), counting calls
n=$(( $(cat "$CALLS" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$CALLS"
case "$(sed -n "${n}p" "$PLAN")" in
  ok) echo "ran: $*"; exit 0 ;;
  misread) echo "slurmstepd-n2: error: $MISREAD" >&2; echo "Abort: MPI_Init_thread failed" >&2; exit 15 ;;
  hang) echo "slurmstepd-n2: error: $MISREAD" >&2; exec sleep 300 ;;  # the others wait in MPI_Init
  *) echo "Traceback: something else" >&2; exit 3 ;;
esac
"""


@pytest.mark.parametrize("mpi, plan, rc, calls", [
    ("pmi2", ["misread", "ok"], 0, 2),                   # the split request: started again
    ("pmi2", ["misread", "misread", "ok"], 0, 3),
    ("pmi2", ["hang", "ok"], 0, 2),                      # ended at once, not after MPI's timeout
    ("pmi2", ["misread", "misread", "misread"], 15, 3),  # at most twice again, then the step's code
    ("pmi2", ["other", "ok"], 3, 1),                     # any other failure ends the job
    ("pmix", ["misread", "ok"], 15, 1),                  # only Slurm's pmi2 plugin has this bug
])
def test_step_starts_again_only_after_the_pmi2_misread(tmp_path, mpi, plan, rc, calls):
    import subprocess

    (tmp_path / "srun").write_text(FAKE_SRUN)
    (tmp_path / "srun").chmod(0o755)
    (tmp_path / "plan").write_text("\n".join(plan) + "\n")
    script = (f"set -euo pipefail\n{sbatch.STEP_FUNCTION}\n"
              f"step srun --mpi={mpi} --ntasks=2 python -m hpc_tba.cli.rank\n")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env={
        **os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "PLAN": str(tmp_path / "plan"),
        "CALLS": str(tmp_path / "calls"), "MISREAD": sbatch.PMI2_MISREAD})
    assert out.returncode == rc, out.stderr
    assert int((tmp_path / "calls").read_text()) == calls
    assert out.stderr.count("starting it again") == (calls - 1)
    assert ("ran: --mpi" in out.stdout) == (rc == 0)  # the step's own output passes through


def test_every_srun_line_of_a_script_goes_through_step():
    text = scripts.preset_script("tba_70b")
    assert sbatch.STEP_FUNCTION in text
    assert text.index("step() {") < text.index("step srun")
    assert [ln for ln in text.splitlines() if "srun " in ln and not ln.lstrip().startswith("#")
            and "step()" not in ln and '"srun --mpi=pmi2"' not in ln] == [
        ln for ln in text.splitlines() if ln.startswith("step srun")]
