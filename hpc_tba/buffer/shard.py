"""One replay-buffer shard: the learner rank's view of the buffer.

A shard owns the prompts with `prompt_id % num_shards == shard_id` (the routing rule of
`hpc_tba.config.topology`), stores their responses packed (`storage.Store`), samples batches for the
learner (`samplers`), tracks staleness, and — given a directory — logs every accepted response to
append-only segment files (`log.ShardLog`), so a restart, a preemption or a different number of
learner ranks rebuilds the same contents.

Replay is the single source of truth: the constructor replays the log through the same `_apply`
path that `add` uses, so the rebuilt shard is exactly the shard that wrote it (same responses, same
order, same evictions, same recent set). `state_dict` only adds what the log cannot know: the
sampling RNG and the log offsets the checkpoint saw, which `load_state_dict` checks are still there.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time

import numpy as np

from hpc_tba.buffer.log import ShardLog, generations, read_manifest, shard_dir
from hpc_tba.buffer.samplers import sample_advantage, sample_tba
from hpc_tba.buffer.segments import (
    SyncRecord,
    TrajRecord,
    encode_sync,
    encode_traj,
    read_segment,
)
from hpc_tba.buffer.storage import Store
from hpc_tba.comm.messages import SampledBatch, TrajectoryBatch
from hpc_tba.config import BufferConfig

STATE_VERSION = 1


class BufferShard:
    """Per-prompt replay storage for one learner rank; see the module docstring.

    Not thread-safe: call it from one thread (the learner's loop), or guard it with a lock.
    """

    def __init__(self, cfg: BufferConfig, *, shard_id: int = 0, num_shards: int = 1,
                 directory: str | None = None, seed: int = 0) -> None:
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} outside 0..{num_shards - 1}")
        self.cfg, self.shard_id, self.num_shards = cfg, shard_id, num_shards
        self.store = Store(per_prompt_capacity=cfg.per_prompt_capacity, capacity=cfg.capacity,
                           eviction=cfg.eviction, duplicates=cfg.duplicates)
        self.rng = np.random.Generator(np.random.PCG64([seed, shard_id]))
        self.sync_version = -1
        self._recent: dict[int, None] = {}  # prompts refreshed since the latest sync, in order
        self._recent_prev: dict[int, None] = {}  # ... in the interval before it
        self._last_sample: dict[str, float] = {}
        self._log: ShardLog | None = None
        if directory is not None:
            self._log = ShardLog(directory, cfg, shard_id=shard_id, num_shards=num_shards)
            self._replay()

    @classmethod
    def load(cls, directory: str, cfg: BufferConfig, *, shard_id: int = 0, num_shards: int = 1,
             seed: int = 0) -> BufferShard:
        """Rebuild a shard from a run's buffer directory, re-routing by prompt id if the number
        of shards changed since it was written (same as the constructor; named for intent)."""
        return cls(cfg, shard_id=shard_id, num_shards=num_shards, directory=directory, seed=seed)

    @classmethod
    def snapshot(cls, directory: str, cfg: BufferConfig) -> tuple[list[BufferShard], dict]:
        """In-memory copies of the newest generation's shards, touching no file (for tools that
        look at a live run), replayed with the config each shard last ran with (`cfg` if none).
        Returns (shards, {"generation", "torn_bytes", "incomplete"})."""
        gens = generations(directory)
        if not gens:
            raise FileNotFoundError(f"no buffer segments under {directory}")
        gen, n = gens[-1]
        shards, info = [], {"generation": gen, "torn_bytes": 0, "incomplete": []}
        for i in range(n):
            path = shard_dir(directory, gen, n, i)
            manifest = read_manifest(path) or {"segments": [], "complete": False, "base": {}}
            known = {f.name for f in dataclasses.fields(BufferConfig)}
            saved = {k: v for k, v in manifest.get("config", {}).items() if k in known}
            run_cfg = BufferConfig(**saved) if saved else cfg
            shard = cls(run_cfg, shard_id=i, num_shards=n)
            if not manifest["complete"]:
                info["incomplete"].append(i)
            for name in manifest["segments"]:
                scan = read_segment(os.path.join(path, name))
                info["torn_bytes"] += scan.torn_bytes
                for rec in scan.records:
                    if isinstance(rec, SyncRecord):
                        shard._apply_sync(rec.version, rec.time)
                    else:
                        shard._apply(rec, log=False)
            for k, v in manifest.get("base", {}).items():
                shard.store.counters[k] += v
            shards.append(shard)
        return shards, info

    # ---------------------------------------------------------------- writing
    def add(self, batch: TrajectoryBatch, *, advantages: np.ndarray | None = None) -> int:
        """Store one prompt's responses; returns how many of them the shard holds afterwards.

        `advantages` ([n] float32, optional) are A-LoL's cached A = R - V(x) for these responses;
        TrajectoryBatch has no field for them. Raises ValueError for a prompt another shard owns.
        """
        if batch.prompt_id % self.num_shards != self.shard_id:
            raise ValueError(f"prompt {batch.prompt_id} belongs to shard "
                             f"{batch.prompt_id % self.num_shards}, not {self.shard_id} "
                             f"of {self.num_shards}")
        if batch.num_responses == 0:
            return 0
        if advantages is not None and np.shape(advantages) != (batch.num_responses,):
            raise ValueError(f"{np.shape(advantages)} advantages for {batch.num_responses} responses")
        rec = TrajRecord(batch.prompt_id, batch.policy_version, batch.searcher_id, batch.timestamp,
                         time.time(), batch.prompt_tokens, batch.lengths, batch.rewards,
                         advantages, batch.response_tokens, batch.logp_behavior,
                         token_versions=batch.token_versions)
        return self._apply(rec, log=self._log is not None)

    def _apply(self, r: TrajRecord, *, log: bool) -> int:
        keep, stored = self.store.add(
            r.prompt_id, r.prompt_tokens, r.response_tokens, r.lengths, r.rewards,
            r.logp_behavior, r.advantages, version=r.policy_version,
            searcher=r.searcher_id, time=r.timestamp, accept=r.accept_time,
            versions=None if r.token_versions is None else np.asarray(r.token_versions, np.int64))
        counters = self.store.counters
        counters["duplicates"] += r.dropped_duplicates  # replayed records carry what add dropped
        counters["rejected"] += r.dropped_over_cap
        if keep.size:
            self._recent.pop(r.prompt_id, None)
            self._recent[r.prompt_id] = None
        if log and keep.size:
            assert self._log is not None
            sub = _subset(r, keep, self.store.last_dropped)
            self._log.append(encode_traj(sub), responses=int(keep.size))
            self._log.maybe_compact(self.store)
        return stored

    def mark_sync(self, version: int) -> None:
        """A weight sync happened: prompts refreshed from now on are the "recent" ones."""
        t = time.time()
        self._apply_sync(version, t)
        if self._log is not None:
            self._log.append(encode_sync(version, t))

    def _apply_sync(self, version: int, t: float) -> None:
        self.sync_version = version
        self._recent_prev, self._recent = self._recent, {}
        self.store.mark_sync(version, t)

    # ---------------------------------------------------------------- reading
    def __len__(self) -> int:
        return self.store.alive

    def ready(self) -> bool:
        """Whether the warm-start threshold is reached (the learner may take its first step)."""
        return self.store.copies >= self.cfg.warm_start  # copies: responses held, counts included

    def sample(self, num_prompts: int, k: int, *, learner_version: int) -> SampledBatch | None:
        """G = num_prompts groups of K rows, contiguous, group ids 0..G-1; None if empty."""
        if self.store.alive == 0 or num_prompts < 1 or k < 1:
            return None
        cfg, n_recent = self.cfg, 0
        if cfg.sampler == "advantage":
            rows = sample_advantage(self.store, num_prompts, k, self.rng)
        else:
            m = cfg.recency_m if cfg.sampler == "tba" else 0.0
            inv_temp = cfg.inv_temp if cfg.sampler == "tba" else 0.0
            rows, n_recent = sample_tba(self.store, num_prompts, k, self.rng, m=m,
                                        inv_temp=inv_temp, recent=self._recent_prompts())
        batch = self._build(rows, num_prompts, k)
        self._last_sample = {"buffer/sample_recent_frac": n_recent / num_prompts,
                             **self.staleness(batch, learner_version)}
        return batch

    def _recent_prompts(self) -> list[int]:
        for d in (self._recent, self._recent_prev):
            live = [p for p in d if p in self.store.prompts]
            if live:
                return live
        return []

    def _build(self, rows: np.ndarray, g: int, k: int) -> SampledBatch:
        s, st = self.store.s, self.store
        idx = st.gather_index(rows)
        bounds = [0, *np.cumsum(s["len"][rows].astype(np.int64)).tolist()]
        spans = list(itertools.pairwise(bounds))

        def split(pool: np.ndarray) -> list[np.ndarray]:  # views into one fresh copy per field
            flat = pool[idx]
            return [flat[a:b] for a, b in spans]

        pids = s["pid"][rows]
        adv = s["adv"][rows]
        return SampledBatch(
            prompt_ids=pids.copy(), group_ids=np.repeat(np.arange(g, dtype=np.int64), k),
            prompt_tokens=[st.prompts[p].tokens for p in pids.tolist()],
            response_tokens=split(st.tok), rewards=s["reward"][rows].copy(),
            logp_behavior=split(st.logp), policy_versions=s["version"][rows].astype(np.int64),
            advantages=None if np.isnan(adv).any() else adv.copy(),
            token_versions=[v.astype(np.int64) for v in split(st.ver)] if st.ver.size else None)

    def staleness(self, batch: SampledBatch, learner_version: int) -> dict[str, float]:
        """Lag between the learner's version and the behaviour versions: per row (of its oldest
        token: `staleness_mean`, `staleness_max` = the oldest token in the sample), per token
        (`staleness_token_mean`), and the most versions one response spans."""
        lag = staleness_lags(batch, learner_version)
        if lag.size == 0:
            return {"buffer/staleness_mean": 0.0, "buffer/staleness_max": 0.0,
                    "buffer/staleness_token_mean": 0.0, "buffer/version_span_max": 0.0}
        tv = batch.row_token_versions()
        tokens = np.concatenate(tv) if tv else np.zeros(0, np.int64)
        span = max((int(v.max() - v.min()) + 1 for v in tv if v.size), default=1)
        return {"buffer/staleness_mean": float(lag.mean()), "buffer/staleness_max": float(lag.max()),
                "buffer/staleness_token_mean": float((learner_version - tokens).mean()) if tokens.size
                else float(lag.mean()), "buffer/version_span_max": float(span)}

    def metrics(self) -> dict[str, float]:
        st = self.store
        live = st.live_slots()
        out = {"buffer/size": float(st.alive), "buffer/copies": float(st.copies),
               "buffer/prompts": float(len(st.prompts)),
               "buffer/recent_prompts": float(len(self._recent)),
               "buffer/resident_bytes": float(st.resident_bytes()),
               "buffer/reward_mean": float(st.s["reward"][live].mean()) if live.size else 0.0,
               **{f"buffer/{k}": float(v) for k, v in st.counters.items()}, **self._last_sample}
        if self._log is not None:
            out.update({f"buffer/{k}": float(v) for k, v in self._log.stats().items()})
        return out

    # ---------------------------------------------------------------- persistence
    def state_dict(self) -> dict:
        """Small, plain-typed state: RNG, sync version and the log offsets (no contents)."""
        return {"format": STATE_VERSION, "shard_id": self.shard_id, "num_shards": self.num_shards,
                "sync_version": self.sync_version, "rng": self.rng.bit_generator.state,
                "log": None if self._log is None else self._log.offsets()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the RNG and check that the log still holds what the checkpoint saw.

        Contents come from the log (replayed in the constructor), which also holds whatever was
        accepted after the checkpoint: nothing accepted is dropped on resume. If the checkpoint
        came from a different shard layout, only the sync version is restored (an RNG stream
        belongs to one shard and does not re-route).
        """
        if state.get("format") != STATE_VERSION:
            raise ValueError(f"buffer state format {state.get('format')} is not {STATE_VERSION}")
        self.sync_version = max(self.sync_version, int(state["sync_version"]))
        if (state["shard_id"], state["num_shards"]) != (self.shard_id, self.num_shards):
            return
        self.rng.bit_generator.state = state["rng"]
        if self._log is not None and state.get("log") is not None:
            self._log.check_offsets(state["log"])

    def flush(self) -> None:
        if self._log is not None:
            self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

    def _replay(self) -> None:
        assert self._log is not None
        importing = self._log.importing
        for rec in self._log.replay(self.shard_id, self.num_shards):
            if isinstance(rec, SyncRecord):
                if not importing or rec.version > self.sync_version:
                    self._apply_sync(rec.version, rec.time)
                    if importing:
                        self._log.append(encode_sync(rec.version, rec.time))
            else:
                self._apply(rec, log=importing)
        self._log.finish_replay(self.store)


def staleness_lags(batch: SampledBatch, learner_version: int) -> np.ndarray:
    """[B] learner_version - policy_version of each row (for a TensorBoard histogram)."""
    return learner_version - batch.policy_versions.astype(np.int64)


def staleness_histogram(batch: SampledBatch, learner_version: int) -> np.ndarray:
    """Counts of rows per lag 0, 1, ..., max lag (negative lags clipped to 0)."""
    return np.bincount(np.maximum(staleness_lags(batch, learner_version), 0))


def _subset(r: TrajRecord, keep: np.ndarray, dropped: tuple[int, int]) -> TrajRecord:
    """The record restricted to the responses the shard kept (what the log stores)."""
    dups, over = r.dropped_duplicates + dropped[0], r.dropped_over_cap + dropped[1]
    if keep.size == r.lengths.size and (dups, over) == (r.dropped_duplicates, r.dropped_over_cap):
        return r
    lens = r.lengths.astype(np.int64)
    starts = np.cumsum(lens) - lens
    idx = np.concatenate([np.arange(starts[i], starts[i] + lens[i]) for i in keep.tolist()])
    tv = None if r.token_versions is None else r.token_versions[idx]
    return TrajRecord(r.prompt_id, r.policy_version if tv is None or not tv.size else int(tv.min()),
                      r.searcher_id, r.timestamp, r.accept_time,
                      r.prompt_tokens, r.lengths[keep], r.rewards[keep],
                      None if r.advantages is None else r.advantages[keep],
                      r.response_tokens[idx], r.logp_behavior[idx], dups, over, tv)
