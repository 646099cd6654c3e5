"""The assembly layer: one layout rule (sbatch script, submitit, planner, `hpc-tba train` and the
ranks' set-up), one rank set-up, one rank command, one engine device rule. No MPI, no engine."""
from __future__ import annotations

import os
import signal
import sys
import types

import pytest
import torch

from hpc_tba.assembly.compose import compose
from hpc_tba.assembly.engines import engine_device
from hpc_tba.assembly.rank import cores_for_rank, setup_rank
from hpc_tba.cli import sbatch, submit
from hpc_tba.config.topology import LayoutError, Role, Topology
from hpc_tba.launcher.local import mpiexec_launch, rank_command
from hpc_tba.plan.planner import make_plan

OFFLINE = ["task=offline", "task.path=/data/rows.jsonl", "algo=sft", "cluster=slurm_cpu",
           "cluster.nodes=2", "cluster.num_learners=2", "cluster.num_searchers=0"]


@pytest.fixture
def rank_state(monkeypatch):
    """setup_rank changes process state (signals, threads, env): put it back afterwards."""
    for k in [k for k in os.environ if k.startswith("SLURM")] + ["SUBMITIT_EXECUTOR"]:
        monkeypatch.delenv(k, raising=False)
    for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(k, "")  # recorded, so the values setup_rank writes are undone too
        monkeypatch.delenv(k)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    threads = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(threads)
    for s, h in handlers.items():
        signal.signal(s, h)


def _ranks(cfg, size: int) -> list[Topology]:
    return [setup_rank(cfg, types.SimpleNamespace(rank=r, size=size)).topology for r in range(size)]


def test_offline_layout_is_one_for_the_script_the_planner_and_the_ranks(rank_state):
    cfg = compose(OFFLINE)
    topo = Topology.for_run(cfg)
    assert (topo.num_learners, topo.num_searchers, topo.tasks_per_node) == (2, 0, [1, 1])
    assert "TASKS=(1 1)" in sbatch.sbatch_script(cfg, OFFLINE, name="off")
    assert submit._slurm_parameters(cfg)["ntasks_per_node"] == 1
    plan = make_plan(cfg)
    assert not plan.problems and "ranks 0 (learner, 1 tasks)" in "\n".join(plan.lines)
    assert _ranks(cfg, 2) == [topo, topo]


@pytest.mark.parametrize("overrides, words", [
    (OFFLINE[:-1] + ["cluster.nodes=3", "cluster.num_learners=1", "cluster.num_searchers=2"],
     "task=offline trains from a file"),
    (["cluster=slurm_cpu", "cluster.nodes=1", "cluster.num_searchers=0"], "no searcher rank"),
])
def test_a_layout_the_ranks_refuse_is_refused_by_the_script_and_the_planner_too(
        rank_state, overrides, words):
    """Before Topology.for_run the sbatch script, submitit and the planner accepted these (their
    rule was `needs_searchers = num_searchers > 0`) and the job failed only once it ran."""
    cfg = compose(overrides)
    with pytest.raises(LayoutError, match=words):
        sbatch.sbatch_script(cfg, overrides, name="x")
    with pytest.raises(LayoutError, match=words):
        submit._slurm_parameters(cfg)
    assert any(words in p for p in make_plan(cfg).problems)
    with pytest.raises(LayoutError, match=words):
        setup_rank(cfg, types.SimpleNamespace(rank=0, size=cfg.cluster.world_size))


def test_setup_rank_on_a_gpu_node(rank_state):
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "g[01-16]", "SLURMD_NODENAME": "g09",
           "SLURM_NODEID": "8", "SLURM_PROCID": "65", "SLURM_NTASKS": "80", "SLURM_LOCALID": "1"}
    for k, v in env.items():
        rank_state.setenv(k, v)
    cfg = compose(["+experiment=tba_70b"])
    rank = setup_rank(cfg, types.SimpleNamespace(rank=65, size=80))
    assert rank.role is Role.SEARCHER and rank.rank == 65 and rank.topology == Topology.for_run(cfg)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # its engine's TP group
    assert os.environ["OMP_NUM_THREADS"] == "8" and torch.get_num_threads() == 8
    assert rank.slurm.restart_count == 0 and not rank.preemption.is_set()
    os.kill(os.getpid(), signal.SIGTERM)  # scancel / the time limit: the flag, not a dead rank
    assert rank.preemption.wait(5) and rank.preemption.signum == signal.SIGTERM
    with pytest.raises(LayoutError, match="needs 80"):
        setup_rank(cfg, types.SimpleNamespace(rank=65, size=81))
    rank_state.setenv("SLURM_NODEID", "3")
    with pytest.raises(LayoutError, match="places it on node 8"):
        setup_rank(cfg, types.SimpleNamespace(rank=65, size=80))


def test_learners_get_cores_of_their_own_first():
    topo = Topology.build(4, 2, 2)
    assert [cores_for_rank(r, topo, 4) for r in range(4)] == [{0}, {1}, {2}, {3}]
    assert [cores_for_rank(r, topo, 3) for r in range(4)] == [{0}, {1}, {2}, {2}]
    assert [cores_for_rank(r, topo, 2) for r in range(4)] == [{0}, {1}, {0}, {1}]


def test_every_launcher_starts_the_one_rank_command():
    cfg = compose(["+experiment=tba_8b"])
    assert rank_command(["a=1"]) == [sys.executable, "-m", "hpc_tba.cli.rank", "a=1"]
    srun = sbatch.srun_command(cfg, ["a=1"], python="py")
    assert srun[-4:] == rank_command(["a=1"], python="py") and srun[0] == "srun"
    cmd, env = mpiexec_launch("/x/mpiexec", 3, ["a=1"], threads=2)
    assert cmd == ["/x/mpiexec", "-n", "3", *rank_command(["a=1"])]
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    assert env["HPC_TBA_MASTER_ADDR"] == os.environ.get("HPC_TBA_MASTER_ADDR", "127.0.0.1")


def test_one_engine_device_rule():
    assert engine_device(compose(["cluster.dist_backend=gloo"])) == "cpu"
    assert engine_device(compose(["cluster.dist_backend=nccl"])) == "cuda"
    assert engine_device(compose([])) == ("cuda" if torch.cuda.is_available() else "cpu")
