"""Removal from a buffer shard's packed storage (`storage.Store`): killing slots, the per-prompt
and global eviction of a full buffer (oldest first, or lowest reward first), and compaction.

Removal (dedupe, per-prompt cap, global eviction) only clears the alive flag; the holes are
squeezed out by `compact` (`_maybe_compact`) once they exceed a tenth of the pool, which keeps
insertion order, so "oldest" is always "lowest live slot" and oldest-first eviction is a forward
scan.

`Removal` is a mixin of `Store`: its methods work on the arrays and counters `Store.__init__`
sets up (`s`, the pools, `n_slots`, `n_tok`, `alive`, `copies`, `dead_tok`, `head`, `marks`,
`syncs`, `_low`, `_low_t`, `prompts`, `capacity`, `eviction`, `counters`, `mutations`) and on
`Store._remove_prompt`.
"""
from __future__ import annotations

import numpy as np

_COMPACT_FRACTION = 0.1


class Removal:
    """Slot removal, eviction and compaction of a `storage.Store` (module docstring)."""

    def _kill(self, slots: np.ndarray) -> None:
        self.mutations += 1
        self.s["alive"][slots] = False
        self.alive -= int(slots.size)
        self.copies -= int(self.s["count"][slots].sum())
        self.dead_tok += int(self.s["len"][slots].sum())

    def _evict_global(self) -> None:
        excess = self.alive - self.capacity if self.capacity else 0
        if excess <= 0:
            return
        alive = self.s["alive"]
        idx = self._oldest(excess) if self.eviction == "oldest" else self._lowest_reward(excess)
        self.counters["evicted"] += int(self.s["count"][idx].sum())
        self._kill(idx)
        for pid in np.unique(self.s["pid"][idx]).tolist():
            entry = self.prompts[pid]
            entry.slots = entry.slots[alive[entry.slots]]
            if entry.slots.size == 0:
                self._remove_prompt(pid)

    def _oldest(self, count: int) -> np.ndarray:
        """The `count` oldest live slots: a forward scan from `head` in growing windows."""
        width = 4 * count + 64
        while True:
            end = min(self.head + width, self.n_slots)
            idx = np.flatnonzero(self.s["alive"][self.head:end])[:count] + self.head
            if idx.size == count or end == self.n_slots:
                self.head = int(idx[-1]) + 1
                return idx
            width *= 4

    def _lowest_reward(self, count: int) -> np.ndarray:
        """The `count` lowest-reward live slots, ties to the oldest.

        Amortised: `_low` holds every live slot with reward <= `_low_t`, sorted by (reward,
        slot), so an eviction pops its front; an O(live) partition refills it only when it runs
        out. New slots are the newest, so one inserted after its equals keeps the order exact.
        """
        live = self._low[self.s["alive"][self._low]]
        if live.size < count:
            self._refill_low(count)
            live = self._low[self.s["alive"][self._low]]
        self._low = live[count:]
        return np.sort(live[:count])

    def _refill_low(self, count: int) -> None:
        live = np.flatnonzero(self.s["alive"][:self.n_slots])
        r = self.s["reward"][live]
        m = min(live.size, max(4 * count, 1024))
        self._low_t = float(np.partition(r, m - 1)[m - 1])
        sel = live[r <= self._low_t]
        self._low = sel[np.lexsort((sel, self.s["reward"][sel]))]

    def _track_low(self, slots: np.ndarray) -> None:
        """Insert new slots whose reward is within the low pool's threshold."""
        r = self.s["reward"][slots]
        new = slots[r <= self._low_t]
        if new.size:
            new_r = self.s["reward"][new]
            order = np.argsort(new_r, kind="stable")  # (reward, slot) order among themselves
            at = np.searchsorted(self.s["reward"][self._low], new_r[order], side="right")
            self._low = np.insert(self._low, at, new[order])

    def _maybe_compact(self) -> None:
        if self.dead_tok > _COMPACT_FRACTION * self.n_tok and self.n_tok > 65536:
            self.compact()

    def compact(self) -> np.ndarray:
        """Squeeze out dead slots and tokens, keeping order; returns the old -> new slot map."""
        n = self.n_slots
        self.mutations += 1
        live = np.flatnonzero(self.s["alive"][:n])
        remap = np.full(n, -1, dtype=np.int64)
        remap[live] = np.arange(live.size)
        lens = self.s["len"][live].astype(np.int64)
        # the pool holds slots' tokens back to back in slot order, so a mask selects the live ones
        # New arrays keep the allocated size: under a global cap the buffer then stops growing.
        keep = np.repeat(self.s["alive"][:n], self.s["len"][:n])
        self.tok, self.logp = _packed(self.tok, keep), _packed(self.logp, keep)
        self.ver = _packed(self.ver, keep) if self.ver.size else self.ver
        for k, arr in self.s.items():
            self.s[k] = _packed(arr, live)
        self.s["off"][:live.size] = np.cumsum(lens) - lens
        self.n_slots, self.n_tok, self.dead_tok, self.head = live.size, int(lens.sum()), 0, 0
        for entry in self.prompts.values():
            entry.slots = remap[entry.slots]
        self.marks = [int((remap[:b] >= 0).sum()) for b in self.marks]
        low = remap[self._low]
        self._low = low[low >= 0]
        return remap

    def mark_sync(self, version: int, t: float) -> None:
        """A weight sync after the slots stored so far: the last two boundaries and their
        (version, time), which the shard's recent set and the log's compaction use."""
        self.marks = (self.marks + [self.n_slots])[-2:]
        self.syncs = (self.syncs + [(version, t)])[-2:]


def _packed(arr: np.ndarray, select: np.ndarray) -> np.ndarray:
    """arr[:len(select)][select] (mask) or arr[select] (indices) in an array of arr's size."""
    picked = arr[:select.size][select] if select.dtype == np.bool_ else arr[select]
    out = np.zeros(arr.size, dtype=arr.dtype)
    out[:picked.size] = picked
    return out
