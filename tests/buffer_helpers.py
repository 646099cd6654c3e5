"""Small builders for buffer tests (no test framework needed): batches with given or random
responses, and what a shard stores, read back for comparison."""
from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import numpy as np

from hpc_tba.buffer.shard import BufferShard
from hpc_tba.comm.messages import TrajectoryBatch


def make_batch(prompt_id: int, responses: Sequence[Sequence[int]], rewards: Sequence[float], *,
               version: int = 0, searcher: int = 0, timestamp: float = 0.0) -> TrajectoryBatch:
    """A batch with the given response token lists; log-probs are a function of the tokens."""
    lens = np.array([len(r) for r in responses], dtype=np.int32)
    toks = np.array([t for r in responses for t in r], dtype=np.int32)
    logp = -0.01 * (toks.astype(np.float32) + 1)
    return TrajectoryBatch(prompt_id=prompt_id, prompt_tokens=np.array([1, prompt_id % 1000, 2],
                                                                       dtype=np.int32),
                           response_tokens=toks, lengths=lens,
                           rewards=np.asarray(rewards, dtype=np.float32), logp_behavior=logp,
                           policy_version=version, searcher_id=searcher, timestamp=timestamp)


def random_batch(rng: np.random.Generator, prompt_id: int, n: int, *, min_len: int = 1,
                 max_len: int = 8, vocab: int = 50, version: int = 0) -> TrajectoryBatch:
    """n random responses; a small vocab and short lengths produce exact duplicates."""
    lens = rng.integers(min_len, max_len + 1, n)
    responses = [rng.integers(0, vocab, int(k)).tolist() for k in lens]
    return make_batch(prompt_id, responses, rng.standard_normal(n).round(3).tolist(),
                      version=version)


def contents(shards: Iterable[BufferShard]) -> collections.Counter:
    """Multiset of (prompt, tokens, reward, version, logp bytes) of every stored response."""
    out: collections.Counter = collections.Counter()
    for shard in shards:
        st = shard.store
        for slot in st.live_slots().tolist():
            o, n = int(st.s["off"][slot]), int(st.s["len"][slot])
            out[(int(st.s["pid"][slot]), tuple(st.tok[o:o + n].tolist()),
                 float(st.s["reward"][slot]), int(st.s["version"][slot]),
                 st.logp[o:o + n].tobytes())] += 1
    return out


def per_prompt(shard: BufferShard) -> dict[int, list[tuple]]:
    """prompt id -> its stored (tokens, reward, version), oldest first."""
    st = shard.store
    out = {}
    for pid, entry in st.prompts.items():
        rows = []
        for slot in entry.slots.tolist():
            o, n = int(st.s["off"][slot]), int(st.s["len"][slot])
            rows.append((tuple(st.tok[o:o + n].tolist()), float(st.s["reward"][slot]),
                         int(st.s["version"][slot])))
        out[pid] = rows
    return out
