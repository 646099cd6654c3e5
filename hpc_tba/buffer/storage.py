"""Packed in-memory storage of one buffer shard: responses in flat arrays, prompts as index arrays.

Every stored response is a *slot*: one row in a set of parallel per-response arrays (prompt id,
offset and length into a shared token pool, reward, advantage, policy version, searcher, times,
a 64-bit content hash and an alive flag). Tokens and per-token log-probs live in one growing
pool per field, so a response costs its raw bytes plus ~60 bytes of metadata, never a Python
object per token. Per-token weight versions (in-flight updates) get a pool of their own, allocated
only once a response with mixed versions arrives; a slot's "version" is its oldest token's.
Each prompt keeps an int64 array of its live slots, oldest first.

Removal (dedupe, per-prompt cap, global eviction) only clears the alive flag; eviction and the
compaction that squeezes out the holes are in buffer/eviction.py (`Removal`, a mixin of `Store`).

Exact duplicates are found by hash and confirmed by comparing tokens, so a hash collision can never
merge two different responses. What happens to them is `duplicates` (BufferConfig.duplicates):

- drop (TBA's buffer): one copy per distinct response, the newest; the per-prompt cap counts
  distinct responses.
- count: one stored copy (the newest) that carries how many times the prompt's responses
  repeated it (`count`); the per-prompt cap counts copies (a prompt holds at most
  `per_prompt_capacity` generated responses, oldest slots evicted first, a count clipped to
  the cap), and samplers draw from `with_copies(slots)` (each slot repeated count times), so a batch
  holds a frequent response as often as keeping every copy would, in the memory of one. The
  durable log records every copy it keeps (replay recomputes the counts); compaction writes a
  slot's copies back out.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from hpc_tba.buffer.eviction import Removal

_GROWTH = 1.125  # growth of large arrays: resident bytes stay close to the raw token bytes
_SMALL = 1 << 16  # arrays below this many entries double instead (fewer copies while filling)
_KEY_BLOCK = 4096
_SLOT_FIELDS = {  # name -> dtype of the per-response arrays
    "pid": np.int64, "off": np.int64, "len": np.int32, "reward": np.float32, "adv": np.float32,
    "version": np.int64, "searcher": np.int32, "time": np.float64, "accept": np.float64,
    "hash": np.uint64, "alive": np.bool_, "count": np.int32,
}
DUPLICATE_RULES = ("drop", "count")
_position_keys = np.zeros(0, dtype=np.uint64)


def _keys(n: int) -> np.ndarray:
    """Fixed random odd multipliers per token position (stable across processes and growth)."""
    global _position_keys
    while _position_keys.size < n:
        block = _position_keys.size // _KEY_BLOCK
        rng = np.random.Generator(np.random.PCG64([0x7BA, block]))
        new = rng.integers(0, 2**63, size=_KEY_BLOCK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        _position_keys = np.concatenate([_position_keys, new])
    return _position_keys[:n]


def hash_responses(tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[n] uint64 content hash of each ragged response (linear hash mod 2^64, then mixed)."""
    if lengths.size == 0:
        return np.zeros(0, dtype=np.uint64)
    lengths = lengths.astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(tokens.size, dtype=np.int64) - np.repeat(starts, lengths)
    prod = (tokens.astype(np.int64).view(np.uint64) + np.uint64(1)) * _keys(int(lengths.max()))[pos]
    h = np.add.reduceat(prod, starts) ^ (lengths.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    h ^= h >> np.uint64(31)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    return h ^ (h >> np.uint64(29))


@dataclasses.dataclass
class Prompt:
    """One prompt's token ids and its live slots, oldest first."""

    tokens: np.ndarray
    slots: np.ndarray


class Store(Removal):
    """Packed storage with per-prompt dedupe and capacity and a global cap with eviction."""

    def __init__(self, *, per_prompt_capacity: int, capacity: int, eviction: str,
                 duplicates: str = "drop") -> None:
        if duplicates not in DUPLICATE_RULES:
            raise ValueError(f"duplicates={duplicates!r} is not one of {', '.join(DUPLICATE_RULES)}")
        self.duplicates = duplicates
        self.per_prompt_capacity = per_prompt_capacity
        self.capacity = capacity
        self.eviction = eviction
        self.s = {k: np.zeros(0, dtype=t) for k, t in _SLOT_FIELDS.items()}
        self.tok = np.zeros(0, dtype=np.int32)
        self.logp = np.zeros(0, dtype=np.float32)
        self.ver = np.zeros(0, dtype=np.int32)  # per-token versions; empty until one is mixed
        self.n_slots = 0  # slots used (live + dead)
        self.n_tok = 0  # pool entries used
        self.alive = 0  # live responses (slots)
        self.copies = 0  # live responses with their counts (== alive under duplicates=drop)
        self.dead_tok = 0
        self.head = 0  # every slot below head is dead
        self.marks: list[int] = []  # slot boundaries of the last weight syncs (kept by compact)
        self.syncs: list[tuple[int, float]] = []  # (version, time) of each mark, same order
        self._low = np.zeros(0, dtype=np.int64)  # lowest-reward eviction candidates, sorted
        self._low_t = -np.inf  # every live slot with reward <= this is in _low
        self.prompts: dict[int, Prompt] = {}
        self.order: list[int] = []  # prompt ids, for O(1) uniform choice
        self.pos: dict[int, int] = {}  # prompt id -> index in order
        self.counters = {"added": 0, "duplicates": 0, "evicted": 0, "rejected": 0}
        self.last_dropped = (0, 0)  # (in-batch duplicates, over per-prompt cap) of the last add
        self.mutations = 0  # bumped by every change of slots; keys `cache`
        self.cache: dict[str, tuple] = {}  # samplers' derived tables (see samplers._adv_table)

    # ---------------------------------------------------------------- insertion
    def add(self, pid: int, prompt_tokens: np.ndarray, tokens: np.ndarray, lengths: np.ndarray,
            rewards: np.ndarray, logp: np.ndarray, adv: np.ndarray | None,
            *, version: int, searcher: int, time: float, accept: float,
            versions: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """Insert one prompt's responses; returns (indices kept before global eviction, stored).

        Order of rules: duplicates inside the batch keep the last copy; a response equal to one
        already stored replaces it (newest kept); the per-prompt cap drops the oldest; the global
        cap then evicts. The first index array is what the durable log records, because replaying
        exactly those responses through this method rebuilds the same state.
        """
        lengths = lengths.astype(np.int32, copy=False)
        hashes = hash_responses(tokens, lengths)
        starts = np.cumsum(lengths, dtype=np.int64) - lengths
        keep, copy_of = self._last_copies(hashes, tokens, starts, lengths)
        cap, n_distinct = self.per_prompt_capacity, keep.size
        counting = self.duplicates == "count"
        counts = np.bincount(copy_of, minlength=lengths.size)[keep] if counting else np.ones(keep.size, np.int64)
        if counting:  # the newest responses whose copies reach the cap (the last one clipped below)
            first = max(keep.size - int(np.searchsorted(np.cumsum(counts[::-1]), cap, side="left")) - 1, 0)
        else:
            first = max(keep.size - cap, 0)
        rejected = int(counts[:first].sum())
        self.counters["rejected"] += rejected
        keep, counts = keep[first:], counts[first:]
        # what the log will not hold (a replay adds it to the counters): under count, the rejected
        # responses' in-batch duplicates and copies (the kept ones' copies are all logged)
        self.last_dropped = (rejected - first, rejected) if counting else (
            int(lengths.size - n_distinct), int(n_distinct - keep.size))
        entry = self.prompts.get(pid)
        if entry is not None and entry.slots.size:
            counts = counts + self._drop_stored_copies(entry, hashes[keep], tokens, starts[keep], lengths[keep])
        if counting:
            counts = _fit_counts(counts, cap)
        if entry is None:
            entry = self._new_prompt(pid, prompt_tokens)
        held = self.s["count"][entry.slots].cumsum() if counting else np.arange(1, entry.slots.size + 1)
        excess = int(held[-1] + counts.sum() - cap) if entry.slots.size else 0
        if excess > 0:  # the prompt's oldest slots make room
            overflow = int(np.searchsorted(held, excess, side="left")) + 1
            self.counters["evicted"] += int(held[overflow - 1])
            self._kill(entry.slots[:overflow])
            entry.slots = entry.slots[overflow:]
        slot_version: int | np.ndarray = version
        if versions is not None and versions.size:  # each response's oldest token
            slot_version = np.minimum.reduceat(versions, starts)[keep]
        new = self._append(pid, tokens, starts[keep], lengths[keep], hashes[keep], rewards[keep],
                           logp, None if adv is None else adv[keep],
                           version=slot_version, searcher=searcher, time=time, accept=accept,
                           versions=versions, counts=counts)
        entry.slots = np.concatenate([entry.slots, new])
        self.counters["added"] += int(keep.size)
        self._evict_global()
        stored = int(self.s["alive"][new].sum())
        self._maybe_compact()
        if counting:  # what the log records: every copy of the kept responses
            return np.flatnonzero(np.isin(copy_of, keep)), stored
        return keep, stored

    def with_copies(self, slots: np.ndarray) -> np.ndarray:
        """`slots` with each repeated its count times (what samplers draw from; the same array
        under duplicates=drop, where every count is 1)."""
        return np.repeat(slots, self.s["count"][slots])

    def _last_copies(self, hashes: np.ndarray, tokens: np.ndarray, starts: np.ndarray,
                     lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The responses to keep: the last copy of each distinct one, in batch order, and for
        every response of the batch the index of its kept copy."""
        n = hashes.size
        _, first_rev = np.unique(hashes[::-1], return_index=True)
        if first_rev.size == n:
            return np.arange(n), np.arange(n)
        keep = np.zeros(n, dtype=bool)
        keep[n - 1 - first_rev] = True
        copy_of = np.arange(n)
        for i in np.flatnonzero(~keep):  # confirm by content: a hash collision keeps both
            later = [j for j in range(i + 1, n) if hashes[j] == hashes[i]
                     and _same(tokens, starts[i], lengths[i], tokens, starts[j], lengths[j])]
            if later:
                copy_of[i] = later[0]
            else:
                keep[i] = True
        for i in range(n - 1, -1, -1):  # resolve chains to the last copy
            copy_of[i] = copy_of[copy_of[i]]
        self.counters["duplicates"] += int(n - keep.sum())
        return np.flatnonzero(keep), copy_of

    def _drop_stored_copies(self, entry: Prompt, hashes: np.ndarray, tokens: np.ndarray,
                            starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Kill stored responses of this prompt that a new response duplicates exactly; returns,
        per new response, the count of the stored copy it replaces (0: none; see `duplicates`)."""
        inherited = np.zeros(hashes.size, dtype=np.int64)
        old_h = self.s["hash"][entry.slots]
        hit_new, hit_old = np.nonzero(hashes[:, None] == old_h[None, :])
        if hit_new.size == 0:
            return inherited
        dead = []
        for i, o in zip(hit_new.tolist(), hit_old.tolist()):
            slot = int(entry.slots[o])
            if _same(tokens, starts[i], lengths[i], self.tok, self.s["off"][slot], self.s["len"][slot]):
                dead.append(slot)
                inherited[i] += int(self.s["count"][slot])
        if dead:
            self._kill(np.asarray(dead, dtype=np.int64))
            self.counters["duplicates"] += len(dead)
            entry.slots = entry.slots[self.s["alive"][entry.slots]]
        return inherited if self.duplicates == "count" else np.zeros_like(inherited)

    def _append(self, pid: int, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                hashes: np.ndarray, rewards: np.ndarray, logp: np.ndarray,
                adv: np.ndarray | None, *, version: int | np.ndarray, searcher: int, time: float,
                accept: float, versions: np.ndarray | None = None,
                counts: np.ndarray | None = None) -> np.ndarray:
        """Copy kept responses into the pools; returns their new slot indices."""
        n, total = lengths.size, int(lengths.sum())
        self._reserve(n, total, has_ver=versions is not None)
        src: slice | np.ndarray = slice(None)  # nothing dropped: copy the flat arrays as they are
        if total != tokens.size:
            src = np.repeat(starts - np.cumsum(lengths, dtype=np.int64) + lengths, lengths) \
                + np.arange(total, dtype=np.int64)
        t0, t1 = self.n_tok, self.n_tok + total
        self.tok[t0:t1] = tokens[src]
        self.logp[t0:t1] = logp[src]
        if self.ver.size:
            self.ver[t0:t1] = versions[src] if versions is not None else np.repeat(
                np.broadcast_to(version, lengths.shape), lengths)
        slots = np.arange(self.n_slots, self.n_slots + n, dtype=np.int64)
        s, a, b = self.s, self.n_slots, self.n_slots + n
        s["pid"][a:b], s["len"][a:b], s["hash"][a:b] = pid, lengths, hashes
        s["off"][a:b] = t0 + np.cumsum(lengths, dtype=np.int64) - lengths
        s["reward"][a:b] = rewards
        s["adv"][a:b] = np.nan if adv is None else adv
        s["version"][a:b], s["searcher"][a:b] = version, searcher
        s["time"][a:b], s["accept"][a:b] = time, accept
        s["alive"][a:b] = True
        s["count"][a:b] = 1 if counts is None else counts
        self.n_slots, self.n_tok, self.alive = b, t1, self.alive + n
        self.copies += int(s["count"][a:b].sum())
        self.mutations += 1
        if self.eviction == "lowest_reward":
            self._track_low(slots)
        return slots

    def _reserve(self, n: int, total: int, *, has_ver: bool = False) -> None:
        if self.n_slots + n > self.s["pid"].size:
            size = max(self.n_slots + n, _next_size(self.s["pid"].size))
            for k, arr in self.s.items():
                self.s[k] = _grown(arr, size, self.n_slots)
        if self.n_tok + total > self.tok.size:
            size = max(self.n_tok + total, _next_size(self.tok.size))
            self.tok = _grown(self.tok, size, self.n_tok)
            self.logp = _grown(self.logp, size, self.n_tok)
            if self.ver.size:
                self.ver = _grown(self.ver, size, self.n_tok)
        if has_ver and self.ver.size < self.tok.size:  # first per-token versions: earlier slots'
            self.ver = np.zeros(self.tok.size, dtype=np.int32)  # tokens carry their slot's version
            self.ver[:self.n_tok] = np.repeat(self.s["version"][:self.n_slots], self.s["len"][:self.n_slots])

    # ---------------------------------------------------------------- prompts
    def _new_prompt(self, pid: int, prompt_tokens: np.ndarray) -> Prompt:
        toks = np.array(prompt_tokens, dtype=np.int32)
        toks.flags.writeable = False  # shared by every sampled row of this prompt
        entry = Prompt(toks, np.zeros(0, dtype=np.int64))
        self.prompts[pid] = entry
        self.pos[pid] = len(self.order)
        self.order.append(pid)
        return entry

    def _remove_prompt(self, pid: int) -> None:
        del self.prompts[pid]
        i = self.pos.pop(pid)
        last = self.order.pop()
        if last != pid:
            self.order[i] = last
            self.pos[last] = i

    # ---------------------------------------------------------------- reading
    def gather_index(self, slots: np.ndarray) -> np.ndarray:
        """Pool indices of the concatenated tokens of `slots`."""
        lens = self.s["len"][slots].astype(np.int64)
        if lens.size == 0:
            return np.zeros(0, dtype=np.int64)
        return np.repeat(self.s["off"][slots] - (np.cumsum(lens) - lens), lens) \
            + np.arange(int(lens.sum()), dtype=np.int64)

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.s["alive"][:self.n_slots])

    def resident_bytes(self) -> int:
        """Bytes held by the arrays (allocated capacity, not just used) plus prompt entries."""
        arrays = sum(a.nbytes for a in self.s.values()) + self.tok.nbytes + self.logp.nbytes \
            + self.ver.nbytes
        prompts = sum(e.tokens.nbytes + e.slots.nbytes + 200 for e in self.prompts.values())
        return int(arrays + prompts + 100 * len(self.order))



def _fit_counts(counts: np.ndarray, cap: int) -> np.ndarray:
    """Counts of one add's responses (oldest first) clipped so that they sum to at most `cap`,
    the newest first, every response keeping one copy (there are at most `cap` of them)."""
    out, budget = counts.copy(), cap
    for i in range(out.size - 1, -1, -1):
        out[i] = min(int(out[i]), budget - i)
        budget -= int(out[i])
    return out


def _next_size(size: int) -> int:
    return max(4096, 2 * size if size < _SMALL else int(size * _GROWTH))


def _grown(arr: np.ndarray, size: int, used: int) -> np.ndarray:
    out = np.zeros(size, dtype=arr.dtype)
    out[:used] = arr[:used]
    return out


def _same(a: np.ndarray, sa: int, la: int, b: np.ndarray, sb: int, lb: int) -> bool:
    return bool(la == lb and np.array_equal(a[sa:sa + la], b[sb:sb + lb]))
