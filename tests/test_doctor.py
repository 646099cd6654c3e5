"""`hpc-tba doctor`, the preflight the sbatch scripts run on every node before any rank starts:
its table here, one line per problem and a non-zero exit for a missing shared directory, too
little staging space or too little host memory for the plan. The run on several virtual nodes
(the cross-node all-reduce) is in tests/test_slurm_local.py's tiny_cpu runs, whose script runs it.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from hpc_tba.assembly.compose import compose
from hpc_tba.cli import doctor
from hpc_tba.cli.scripts import PRESETS, preset_script
from hpc_tba.plan.planner import PlanOptions, make_plan

SEVENTY_B = "model.path=/models/llama-3.1-70b"  # the planner knows the shape by name: no files needed


def _doctor(*args: str, tmp_path) -> tuple[int, str, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "hpc_tba.cli.doctor", *args, f"run_dir={tmp_path}/run"],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, [ln for ln in proc.stderr.splitlines() if ln.strip()]


def test_doctor_prints_its_table_and_passes_here(tmp_path):
    code, out, err = _doctor(tmp_path=tmp_path)
    assert code == 0, err
    assert err == []
    for row in ("GPUs", "driver / CUDA / NCCL", "packages (hpc_tba/pins.py)", "network (NCCL)",
                "shared directory", "checkpoint staging", "/dev/shm", "host memory"):
        assert row in out, out
    assert "FAIL" not in out
    assert not (tmp_path / "run").exists()  # by hand, outside a Slurm job, it writes nothing


@pytest.mark.parametrize("args, needle", [
    (["cluster.shared_dir=/nonexistent/shared"], "shared directory /nonexistent/shared does not exist"),
    ([SEVENTY_B, "cluster.checkpoint_staging_dir=/dev/shm"], "checkpoint staging /dev/shm has"),
    ([SEVENTY_B], "host memory"),
])
def test_each_problem_is_one_line_and_a_failure(args, needle, tmp_path):
    code, out, err = _doctor(*args, tmp_path=tmp_path)
    assert code == 1, out
    assert any(needle in line for line in err), err
    assert all(line.startswith("hpc-tba doctor: node 0: ") for line in err), err
    assert len(err) == sum("FAIL" in row for row in out.splitlines()), (out, err)


def test_host_memory_is_checked_against_the_plans_figure_for_the_nodes_kind():
    cfg = compose([SEVENTY_B])
    plan = make_plan(cfg, PlanOptions(deepspeed=False))
    need = doctor.host_need(plan, cfg, doctor.node_kind(cfg, 0))
    assert need > doctor.host_memory_bytes()  # a 70B learner's states in this machine's memory
    check = doctor.check_memory(cfg, plan, "learner0")
    assert check.problem and f"{need / 2**30:.1f} GiB" in check.problem


def test_meminfo_and_cgroup_limit(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n")
    (tmp_path / "max").write_text("8000000000\n")
    assert doctor.host_memory_bytes(str(tmp_path / "meminfo"), str(tmp_path / "max")) == 8_000_000_000
    (tmp_path / "max").write_text("max\n")
    assert doctor.host_memory_bytes(str(tmp_path / "meminfo"), str(tmp_path / "max")) == 16384000 * 1024


def test_nccl_socket_ifname_syntax():
    assert doctor._matches_ifname("ib0", "ib")
    assert not doctor._matches_ifname("eth0", "ib,ens")
    assert doctor._matches_ifname("eth0", "^docker,lo")
    assert not doctor._matches_ifname("docker0", "^docker,lo")
    assert doctor._matches_ifname("eth0", "=eth0") and not doctor._matches_ifname("eth01", "=eth0")


def test_network_check_names_a_socket_ifname_that_matches_nothing(tmp_path):
    (tmp_path / "class" / "net" / "lo").mkdir(parents=True)
    (tmp_path / "class" / "net" / "eth0").mkdir()
    cfg = compose(["+cluster.env.NCCL_SOCKET_IFNAME=ib"])
    check = doctor.check_network(cfg, multi_node=True, sys_root=str(tmp_path))
    assert "NCCL_SOCKET_IFNAME=ib matches none" in check.problem
    ok = doctor.check_network(compose([]), multi_node=True, sys_root=str(tmp_path))
    assert not ok.problem and "eth0" in ok.value


def test_table_folds_rows_every_node_agrees_on():
    a = [doctor.Check("GPUs", "8 (plan 8)"), doctor.Check("host memory", "1 GiB")]
    b = [doctor.Check("GPUs", "8 (plan 8)"), doctor.Check("host memory", "2 GiB", "too little")]
    text = doctor.format_table([a, b])
    assert [ln.split() for ln in text.splitlines()][0] == ["GPUs", "8", "(plan", "8)", "(all", "2", "nodes)"]
    assert "node 1: FAIL 2 GiB" in text
    assert doctor.problems([a, b]) == ["node 1: too little"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_sbatch_script_runs_the_doctor_on_every_node_before_the_ranks(name):
    text = preset_script(name)
    doctor_at = text.index("-m hpc_tba.cli.doctor")
    assert doctor_at < text.index("-m hpc_tba.cli.rank")
    assert doctor_at < text.index('mkdir -p "$RUN_DIR"')  # nothing written before the preflight passed
    line = text[:doctor_at].rsplit("srun", 1)[1]
    nodes = compose(list(PRESETS[name])).cluster.nodes
    assert f"--nodes={nodes} --ntasks={nodes} --ntasks-per-node=1" in line
