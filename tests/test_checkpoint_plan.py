"""Checkpoints sized for 70B (issue 23, item 4): the planner prints a checkpoint's size, its
footprint on the shared filesystem and its save time at `cluster.checkpoint_gb_per_s`, and
refuses a Slurm run whose USR1 grace cannot hold a save (plan, sbatch generator, submitit)."""
from __future__ import annotations

import pytest

from hpc_tba.assembly.compose import compose
from hpc_tba.cli import scripts
from hpc_tba.plan.checkpoint import CHECKPOINT_BYTES_PER_PARAM, GRACE_MARGIN, checkpoint_cost, grace_refusal
from hpc_tba.plan.planner import KNOWN_MODELS, PlanOptions, check_grace, make_plan, plan_main

FAST = PlanOptions(deepspeed=False)
P70 = KNOWN_MODELS["llama-3.1-70b"].params


def test_70b_plan_prints_checkpoint_size_footprint_and_save_time(capsys):
    assert plan_main(["+experiment=tba_70b", "--no-deepspeed"]) == 0
    out = capsys.readouterr().out
    size = CHECKPOINT_BYTES_PER_PARAM * P70
    assert f"{size / 1e9:.3g} GB, {size / 64 / 1e9:.3g} GB per rank" in out  # 847 GB, 13.2 GB
    assert "save to the shared filesystem" in out and f"{size / 1e9:.0f} s" in out
    plan = make_plan(compose(["+experiment=tba_70b"]), FAST)
    assert plan.terms["checkpoint"] == size
    assert plan.terms["checkpoint_footprint"] == size * 3  # keep_last 2 + the one being written


def test_save_time_follows_the_bandwidth_and_the_footprint_keep_last():
    base = compose(["+experiment=tba_70b"])
    fast = compose(["+experiment=tba_70b", "cluster.checkpoint_gb_per_s=4", "learner.keep_last=1"])
    spec = KNOWN_MODELS["llama-3.1-70b"]
    (b1, s1, _), (b4, s4, g4) = checkpoint_cost(base, spec), checkpoint_cost(fast, spec)
    assert b1 == b4 and s1 == pytest.approx(4 * s4)
    assert g4 == pytest.approx(GRACE_MARGIN[0] * s4 + GRACE_MARGIN[1])
    assert make_plan(fast, FAST).terms["checkpoint_footprint"] == 2 * b4


def test_a_grace_shorter_than_a_save_is_refused_naming_the_save(capsys):
    assert plan_main(["+experiment=tba_70b", "cluster.signal_grace_s=60", "--no-deepspeed"]) == 1
    out = capsys.readouterr().out
    refusal = out.split("REFUSED:")[1]
    assert "cluster.signal_grace_s=60 is shorter than the checkpoint save" in refusal
    assert "847 GB at 1 GB/s" in refusal and "take 847 s" in refusal
    # a faster filesystem makes the same grace enough
    ok = compose(["+experiment=tba_70b", "cluster.signal_grace_s=600", "cluster.checkpoint_gb_per_s=2"])
    assert make_plan(ok, FAST).fits
    # the local backend has no USR1 grace to refuse
    local = compose(["+experiment=tba_70b", "cluster.backend=local", "cluster.signal_grace_s=60"])
    assert not any("signal_grace_s" in p for p in make_plan(local, FAST).problems)


def test_sbatch_and_submitit_refuse_a_short_grace_before_queueing(tmp_path, capsys):
    short = ["+experiment=tba_70b", "cluster.signal_grace_s=60"]
    assert scripts.main(["sbatch", *short]) == 2
    assert "shorter than the checkpoint save" in capsys.readouterr().err
    with pytest.raises(ValueError, match="shorter than the checkpoint save"):
        check_grace(compose(short))
    pytest.importorskip("submitit")
    from hpc_tba.cli.submit import launch

    with pytest.raises(ValueError, match="shorter than the checkpoint save"):
        launch(compose(short), executor="slurm", folder=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written, nothing queued


@pytest.mark.parametrize("preset, arch", [
    ("tba_70b", "llama-3.1-70b"), ("tba_8b", "llama-3.1-8b"), ("topr_offline", "llama-3.1-8b"),
    ("alol_hh", "llama-3.1-8b"), ("gsm8k_rho1b", "llama-3.2-1b")])
def test_gpu_presets_checkpoint_on_an_interval_within_their_grace(preset, arch):
    """Every GPU-cluster preset saves on a wall-clock interval, and its grace holds a save of its
    model (or of a larger stand-in of the same family: the 7B and 8B presets as Llama-3.1-8B)."""
    cfg = compose([f"+experiment={preset}"])
    assert cfg.learner.checkpoint_interval_s > 0
    assert grace_refusal(cfg, KNOWN_MODELS[arch]) is None
    _, save_s, _ = checkpoint_cost(cfg, KNOWN_MODELS[arch])
    assert cfg.learner.checkpoint_interval_s >= 4 * save_s  # copies never queue behind each other
