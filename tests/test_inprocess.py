"""The in-process runner (hpc_tba.assembly.inprocess): every rank a thread of one process.

The thread machinery and the refusals are unit tests; the whole loop (1 learner + 1 searcher on
the embedded default model: vLLM, DeepSpeed ZeRO-3, the gloo weight sync; ~17 s) is heavy: run
it under the machine lock."""
from __future__ import annotations

import json
import threading
import time
import types

import pytest

from hpc_tba.assembly.compose import compose
from hpc_tba.assembly.inprocess import InProcessError, check_config, run_in_process, run_ranks
from hpc_tba.comm.messages import Done, Stop


class _Ping:
    """A stand-in role: rank 1 sends DONE and waits for STOP; rank 0 answers with STOP."""

    def __init__(self, t, fail: bool = False):
        self.t, self.fail, self.closed = t, fail, False

    def run(self):
        if self.t.rank == 1:
            self.t.send(0, Done(4))
            while not (got := self.t.receive(Stop)):
                time.sleep(0.001)
            return got[0][1].policy_version
        if self.fail:
            raise ValueError("the learner broke")
        while not (got := self.t.receive(Done)):
            time.sleep(0.001)
        self.t.send(1, Stop(got[0][1].sent + 1))
        return "learner"

    def close(self):
        self.closed = True


def test_ranks_run_as_threads_and_return_their_results():
    roles = []

    def make(t):
        roles.append(_Ping(t))
        return roles[-1]

    assert run_ranks(2, make) == ["learner", 5]
    assert all(r.closed for r in roles)


def test_a_failing_rank_aborts_the_others_and_its_error_is_raised():
    roles = []

    def make(t):
        roles.append(_Ping(t, fail=True))
        return roles[-1]

    t0 = time.time()
    with pytest.raises(RuntimeError, match="rank 0 failed: ValueError: the learner broke"):
        run_ranks(2, make)  # rank 1 waits for a STOP that never comes: the abort ends it
    assert time.time() - t0 < 10 and all(r.closed for r in roles)


def test_a_rank_blocked_outside_the_transport_is_left_behind_after_the_grace():
    release = threading.Event()

    def make(t):
        if t.rank == 1:  # e.g. waiting in a gloo rendezvous for a learner that died
            return types.SimpleNamespace(run=lambda: release.wait(60), close=lambda: None)
        return _Ping(t, fail=True)

    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"rank 0 failed.*\(rank1 still blocked 1 s later, left behind\)"):
        run_ranks(2, make, abort_grace_s=1.0)
    assert time.time() - t0 < 10
    release.set()


def test_what_one_process_cannot_hold_is_refused_by_name(tmp_path):
    with pytest.raises(InProcessError, match="num_learners=2.*one learner"):
        check_config(compose(["cluster.num_learners=2", f"run_dir={tmp_path}"]))
    with pytest.raises(InProcessError, match="dist_backend=nccl.*gloo"):
        check_config(compose(["cluster.dist_backend=nccl", "cluster.num_searchers=1", f"run_dir={tmp_path}"]))
    with pytest.raises(InProcessError, match="num_searchers=2 with in-process engines.*engine_process=true"):
        check_config(compose([f"run_dir={tmp_path}"]))  # the default: 2 searchers
    check_config(compose(["searcher.engine_process=true", f"run_dir={tmp_path}"]))
    with pytest.raises(InProcessError, match="num_learners=2"):  # before anything is built
        run_in_process(compose(["cluster.num_learners=2", f"run_dir={tmp_path}"]))


STEPS = 3


def test_whole_loop_in_one_process_trains_and_syncs_weights(tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose([f"learner.total_steps={STEPS}", "learner.sync_every=1", "learner.eval_every=0",
                   "learner.sync_check=true", "learner.export_final=false", "learner.prompts_per_step=4",
                   "searcher.k=4", "buffer.warm_start=16", "cluster.num_searchers=1",
                   "learner.micro_batch_size=0", f"run_dir={run_dir}"])
    summary = run_in_process(cfg)
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    assert summary["trajectories_received"]["1"] > 0  # the searcher thread's trajectories
    rows = [json.loads(line) for line in open(run_dir / "metrics_learner.jsonl")]
    assert [r["step"] for r in rows if "loss/tb" in r] == list(range(1, STEPS + 1))
    gaps = summary["sync_logprob_gap"]["1"]  # the engine's log-probs after each applied version
    assert int(max(gaps, key=int)) == STEPS and max(gaps.values()) < 1e-4, gaps
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
