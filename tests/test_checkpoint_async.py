"""Staged checkpoint saves (hpc_tba.checkpoint.staging) on a real 1-rank ZeRO-3 engine:

(a) training steps go on while a save is copied to the run directory (the copy slowed by the
    test hook), and training waited only for the node-local write;
(b) a run's final save (USR1) arriving while a copy is in flight drops that copy whole and writes
    the newest state; at no moment does `latest_checkpoint` (resume=auto) point at a partial
    directory, and nothing `.tmp-*` or staged is left behind;
(c) both checkpoints load bit-exactly (weights, fp32 master, Adam moments, scheduler, RNG), also
    into a policy built without its base weights (`load_causal_lm(weights=False)`, the resume
    path); and the planner's CHECKPOINT_BYTES_PER_PARAM is what DeepSpeed writes.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
from conftest import spawn_ranks
from test_checkpoint_trust import BATCH, SEQ, VOCAB, _batches, _differences, _engine, _snapshot, _step

DELAY_S = 0.4  # per file copied: DeepSpeed's 2 files + rank0.json + rng + learner.json


def _watch(run_dir: str, seen: list) -> None:
    """What resume=auto would pick now, and whether it is complete."""
    from hpc_tba.checkpoint.runfiles import COMPLETE, latest_checkpoint

    p = latest_checkpoint(run_dir)
    seen.append(None if p is None else (os.path.basename(p), os.path.isfile(os.path.join(p, COMPLETE))))


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", HPC_TBA_FAULT_SLOW_CKPT_COPY_S=str(DELAY_S))
    import deepspeed

    from hpc_tba.checkpoint import store as checkpoint
    from hpc_tba.checkpoint.staging import Checkpointer, staging_dir

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    tmp_path, batches = Path(tmp), _batches(40)
    run_dir = str(tmp_path / "run")
    stage = staging_dir(str(tmp_path / "local"), run_dir)
    a = _engine(seed=0)
    ck = Checkpointer(a, run_dir=run_dir, learner_rank=0, keep_last=2, staging=stage)
    seen, rep = [], {}
    base = []
    for ids in batches[:6]:
        t0 = time.perf_counter()
        _step(a, ids)
        base.append(time.perf_counter() - t0)
    ck.save(step=6, shard_state={"s": 6}, learner_state={"step": 6}, final=True)  # a previous one

    # (a) a staged save: training waits for the local write only, then steps during the copy
    t0 = time.perf_counter()
    ck.save(step=7, shard_state={"s": 7}, learner_state={"step": 7}, final=False)
    rep["stall_s"] = time.perf_counter() - t0
    saved7 = _snapshot(a)
    during, i = [], 6
    while ck.copying():
        _watch(run_dir, seen)
        t1 = time.perf_counter()
        _step(a, batches[i % len(batches)])
        during.append(time.perf_counter() - t1)
        i += 1
    rep["copy_s"] = time.perf_counter() - t0
    rep["tmp_while_copying"] = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert ck.agreed(copying_anywhere=False) == 7
    _watch(run_dir, seen)
    rep.update(base_step_s=statistics.median(base), steps_during_copy=len(during),
               step_during_copy_s=statistics.median(during) if during else None)

    # (b) USR1 while the next copy is in flight: dropped whole, the newest state written directly
    ck.save(step=20, shard_state={"s": 20}, learner_state={"step": 20}, final=False)
    _step(a, batches[0])
    _watch(run_dir, seen)
    ck.save(step=21, shard_state={"s": 21}, learner_state={"step": 21}, final=True)
    saved21 = _snapshot(a)
    _watch(run_dir, seen)
    root = Path(run_dir, "checkpoints")
    rep["after_final"] = sorted(os.listdir(root))
    rep["staging_left"] = sorted(str(p.relative_to(stage)) for p in Path(stage).rglob("*") if p.is_file())
    rep["seen"] = seen
    optim = next((root / "step_000021" / "ds").glob("*optim_states.pt"))
    rep["optim_bytes_per_param"] = optim.stat().st_size / sum(p.ds_numel for p in a.module.parameters())

    # (c) each loads bit-exactly into a fresh engine
    b = _engine(seed=1)  # different initial weights: a no-op load cannot pass
    for step, saved in ((7, saved7), (21, saved21)):
        learner_state, shard_state = checkpoint.load(b, str(root / f"step_{step:06d}"), learner_rank=0)
        rep[f"load_{step}"] = [learner_state, shard_state, _differences(_snapshot(b), saved)]
    rep["unloaded_policy_21"] = _differences(_snapshot(_unloaded_policy(tmp_path / "model", root)), saved21)
    (tmp_path / "report.json").write_text(json.dumps(rep))


def _unloaded_policy(model_dir: Path, root: Path):
    """The learner's resume: the policy built with `weights=False` (no base tensors read), then
    the checkpoint loaded; the base model on disk holds other weights than the checkpoint."""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_tba.checkpoint import store as checkpoint
    from hpc_tba.config import LearnerConfig
    from hpc_tba.models.loading import load_causal_lm
    from hpc_tba.roles.learner import deepspeed_config

    torch.manual_seed(3)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                 max_position_embeddings=SEQ)).save_pretrained(model_dir)
    cfg = LearnerConfig(lr=1e-2, warmup_steps=3)
    ds = deepspeed_config(cfg, micro_batch=BATCH, train=True)
    model = load_causal_lm(str(model_dir), dtype=torch.float32, zero3_config=ds, rank=0, weights=False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds)
    checkpoint.load(engine, str(root / "step_000021"), learner_rank=0)
    return engine


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from hpc_tba.comm.groups import free_ports

    tmp = tmp_path_factory.mktemp("async_ckpt")
    spawn_ranks(_worker, 1, (free_ports(1)[0], str(tmp)), timeout_s=900)  # a hung rank fails the test
    return json.loads((tmp / "report.json").read_text())


def test_training_steps_while_a_save_is_copied(report):
    # the copy takes >= 5 files x DELAY_S; training waited a fraction of it
    assert report["copy_s"] >= 5 * DELAY_S
    assert report["stall_s"] < report["copy_s"] / 3, report
    assert report["steps_during_copy"] >= 3, report
    # steps during the copy are not slowed to a crawl (loose: measured under load)
    assert report["step_during_copy_s"] < 3 * report["base_step_s"] + 0.05, report
    assert report["tmp_while_copying"] == [".tmp-step_000007", "latest", "step_000006"]


def test_final_save_during_a_copy_drops_it_whole_and_resume_never_sees_a_partial(report):
    assert report["after_final"] == ["latest", "step_000007", "step_000021"]  # 20 dropped, keep_last 2
    assert report["staging_left"] == []
    names = [s for s in report["seen"]]
    assert all(s is not None and s[1] for s in names), names  # always a complete checkpoint
    assert [s[0] for s in names] == sorted(s[0] for s in names)  # only ever moves forward
    assert names[0][0] == "step_000006" and names[-1][0] == "step_000021"
    assert "step_000020" not in {s[0] for s in names}


def test_staged_and_direct_checkpoints_load_bit_exactly(report):
    for step in (7, 21):
        learner_state, shard_state, diffs = report[f"load_{step}"]
        assert learner_state == {"step": step} and shard_state == {"s": step}
        assert diffs == [], diffs


def test_a_policy_built_without_base_weights_resumes_bit_exactly(report):
    """Resume reads the base model once: the policy's own base tensors are never read (the
    reference, frozen, still loads them), and the checkpoint restores it whole."""
    assert report["unloaded_policy_21"] == []


def test_planner_bytes_per_param_is_what_deepspeed_writes(report):
    from hpc_tba.plan.checkpoint import CHECKPOINT_BYTES_PER_PARAM

    assert CHECKPOINT_BYTES_PER_PARAM <= report["optim_bytes_per_param"] < CHECKPOINT_BYTES_PER_PARAM + 0.5
