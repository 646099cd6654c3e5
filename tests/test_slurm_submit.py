"""hpc_tba.launch through submitit: the parameters mirror the sbatch scripts, a RunConfig turns
into the overrides every rank composes, and the local executor runs the tiny run to completion."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from hpc_tba.assembly.compose import compose
from hpc_tba.cli import submit
from hpc_tba.launcher import slurm

REPO = Path(__file__).resolve().parents[1]


def test_slurm_parameters_mirror_the_70b_script():
    p = submit._slurm_parameters(compose(["+experiment=tba_70b"]))
    assert (p["nodes"], p["ntasks_per_node"], p["cpus_per_task"], p["gpus_per_node"]) == (16, 8, 13, 8)
    assert p["time"] == 2 * 24 * 60 and p["signal_delay_s"] == 1500 and p["exclusive"]
    assert p["srun_args"] == ["--mpi=pmi2", "--distribution=arbitrary", "--ntasks=80"]
    assert "TASKS=(8 8 8 8 8 8 8 8 2 2 2 2 2 2 2 2)" in p["setup"][-1]


def test_the_executor_waits_for_one_result_per_rank(tmp_path):
    ex = submit._RankExecutor(folder=tmp_path)
    ex.world_size = 80  # not 16 nodes x 8 task slots = 128
    assert ex._num_tasks() == 80


@pytest.mark.parametrize("text, minutes", [("2-00:00:00", 2880), ("04:00:00", 240), ("90", 90),
                                           ("1-2", 1560), ("00:30:00", 30)])
def test_slurm_time_to_minutes(text, minutes):
    assert submit._minutes(text) == minutes


def test_a_run_config_becomes_overrides_that_recreate_it():
    cfg = compose(["cluster=slurm_cpu", "learner.total_steps=3", "+cluster.env.NCCL_X=1",
                   "task.prompt_template='Q: {question}\\n\\'A\\':'"])
    overrides = submit.config_overrides(cfg)
    assert "learner.total_steps=3" in overrides and "+cluster.env.NCCL_X='1'" in overrides
    assert compose(overrides) == cfg
    ranks = submit._run_overrides(cfg, ["cluster=slurm_cpu", "run_dir=/elsewhere"])
    assert ranks == ["cluster=slurm_cpu", f"run_dir={cfg.run_dir}"]


def test_submitit_signal_also_sets_the_preemption_flag():
    assert slurm.preemption_signals({}) == (signal.SIGUSR1,)
    assert slurm.preemption_signals({"SUBMITIT_EXECUTOR": "slurm"}) == (
        signal.SIGUSR1, signal.SIGUSR2)


def test_rank_entry_checkpoint_requeues_the_same_ranks():
    entry = submit.RankEntry(["cluster=slurm_cpu"])
    delayed = entry.checkpoint()
    assert delayed.function.overrides == ["cluster=slurm_cpu"]


@pytest.mark.long
@pytest.mark.mpi
def test_launch_local_executor_completes(tmp_path):
    overrides = ["learner.total_steps=3", "learner.eval_every=0", f"run_dir={tmp_path / 'run'}"]
    job = submit.launch(compose(overrides), executor="local", overrides=overrides,
                        folder=tmp_path / "submitit")
    assert job.result() == 0
    assert (tmp_path / "run" / "summary.json").is_file()
    assert list((tmp_path / "run" / "tb").rglob("events.out.tfevents.*"))
