"""Replay buffer: per-prompt storage, samplers, sharding, durability.

    shard = BufferShard(cfg, shard_id=rank, num_shards=L, directory=f"{run_dir}/buffer")
    shard.add(trajectory_batch)                  # on every message from a searcher
    if shard.ready():
        batch = shard.sample(G, K, learner_version=step)
    shard.mark_sync(version)                     # at every weight sync

With a directory the shard replays its segment log on construction (re-routing prompts if the
number of shards changed), so the same call resumes a run.
"""
from hpc_tba.buffer.shard import BufferShard, staleness_histogram, staleness_lags

__all__ = ["BufferShard", "staleness_histogram", "staleness_lags"]
