"""Which stored responses a learner step trains on (ALGORITHMS.md §1 batch sampling, §3).

A batch is G prompt slots of K responses each. Every sampler returns the chosen slot indices as
one int64 array of G*K rows, grouped by prompt slot.

- tba: each slot independently is a *recency* slot with probability m (a prompt refreshed since the
  latest weight sync, and its K newest responses) or a *priority* slot (any stored prompt, K
  responses drawn without replacement with probability ∝ softmax(inv_temp · reward); inv_temp 0
  is uniform). Weighted draws without replacement use Gumbel-top-k, which is exactly successive
  sampling: the first pick is ∝ softmax, the next ∝ softmax over the rest, and so on.
- uniform: every slot a priority slot with inv_temp 0.
- advantage (A-LoL): a row is drawn ∝ A+ = max(A, 0) over the whole shard and its prompt fills the
  slot, so a prompt is picked ∝ the sum of its A+; its K rows are then drawn ∝ A+ among rows with
  A+ > 0. With K = 1 this is exactly A-LoL's per-example ∝ A+ sampling. Rows without a stored
  advantage use their reward (R-LoL). If no row has A+ > 0 the batch falls back to uniform.

Departures, all deliberate: prompts are distinct within a batch while the shard holds enough of
them (a repeated group adds no information to TB's per-prompt logZ); when no prompt was refreshed
since the latest sync, recency slots use the prompts refreshed in the interval before it (right
after a sync the current set is empty, yet those are the freshest samples there are); if there
are still too few recent prompts, the remaining slots become priority slots. Sampling is with
replacement only when a prompt holds fewer than K eligible responses: then each appears once and
the remaining K - n rows are drawn i.i.d. with the same weights.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpc_tba.buffer.storage import Store


def choose_rows(n: int, k: int, rng: np.random.Generator,
                logits: np.ndarray | None = None) -> np.ndarray:
    """k indices into range(n): without replacement (Gumbel-top-k) if n >= k, else all + fill."""
    if n >= k:
        if n == k:
            return np.arange(n)
        keys = rng.random(n) if logits is None else logits + rng.gumbel(size=n)
        return np.argpartition(-keys, k - 1)[:k]
    p = None
    if logits is not None:
        p = np.exp(logits - logits.max())
        p /= p.sum()
    return np.concatenate([np.arange(n), rng.choice(n, k - n, p=p)])


def distinct_prompts(order: Sequence[int], count: int, rng: np.random.Generator,
                     exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """`count` prompt ids uniformly from `order`, distinct and outside `exclude` while possible."""
    n = len(order)
    if n and 2 * (count + len(exclude)) <= n:  # plenty to choose from: rejection, O(count)
        seen, out = set(exclude), []
        while len(out) < count:
            p = order[int(rng.integers(n))]
            if p not in seen:
                seen.add(p)
                out.append(p)
        return out
    pool = [p for p in order if p not in exclude] if exclude else order
    if not pool:
        pool = order
    if count <= len(pool):
        return [pool[i] for i in rng.choice(len(pool), count, replace=False).tolist()]
    return [pool[i] for i in rng.integers(0, len(pool), count).tolist()]


def _recency_rows(slots: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    if slots.size >= k:
        return slots[slots.size - k:]
    return slots[choose_rows(slots.size, k, rng)]


def _priority_rows(store: Store, slots: np.ndarray, k: int, rng: np.random.Generator,
                   inv_temp: float) -> np.ndarray:
    logits = None
    if inv_temp:
        logits = inv_temp * store.s["reward"][slots].astype(np.float64)
    return slots[choose_rows(slots.size, k, rng, logits)]


def sample_tba(store: Store, g: int, k: int, rng: np.random.Generator, *, m: float,
               inv_temp: float, recent: Sequence[int]) -> tuple[np.ndarray, int]:
    """TBA's sampler; returns (rows [g*k], number of recency slots)."""
    want_recent = int((rng.random(g) < m).sum()) if m > 0 else 0
    rec = distinct_prompts(recent, min(want_recent, len(recent)), rng) if recent else []
    rest = distinct_prompts(store.order, g - len(rec), rng, exclude=set(rec))
    rows = [_recency_rows(store.with_copies(store.prompts[p].slots), k, rng) for p in rec]
    rows += [_priority_rows(store, store.with_copies(store.prompts[p].slots), k, rng, inv_temp) for p in rest]
    return np.concatenate(rows), len(rec)


def sample_advantage(store: Store, g: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A-LoL's sampler: rows ∝ max(A, 0), grouped by prompt (see the module docstring)."""
    live, cdf = _adv_table(store)
    total = float(cdf[-1]) if cdf.size else 0.0
    if total <= 0.0:
        return sample_tba(store, g, k, rng, m=0.0, inv_temp=0.0, recent=())[0]
    picks = live[np.searchsorted(cdf, rng.random(g) * total, side="right")]
    rows = []
    for pid in store.s["pid"][picks].tolist():
        slots = store.with_copies(store.prompts[pid].slots)
        w = _adv_weights(store, slots)
        slots = slots[w > 0]
        rows.append(slots[choose_rows(slots.size, k, rng, np.log(w[w > 0]))])
    return np.concatenate(rows)


def _adv_table(store: Store) -> tuple[np.ndarray, np.ndarray]:
    """(live slots, cumulative A+) — cached until the store next changes, since offline A-LoL
    fills the buffer once and then samples it many times."""
    cached = store.cache.get("adv")
    if cached is None or cached[0] != store.mutations:
        live = store.live_slots()
        cached = (store.mutations, live, np.cumsum(_adv_weights(store, live) * store.s["count"][live]))
        store.cache["adv"] = cached
    return cached[1], cached[2]


def _adv_weights(store: Store, slots: np.ndarray) -> np.ndarray:
    a = store.s["adv"][slots].astype(np.float64)
    missing = np.isnan(a)
    if missing.any():
        a[missing] = store.s["reward"][slots][missing]
    return np.maximum(a, 0.0)
