"""The searcher's end of an out-of-process engine's weight feed: an engine whose workers receive
every version from the learner themselves (worker_groups.py; engine/worker_sync.py is their end).
`EngineOffers` (a base of receiver.py's `WeightReceiver`) joins the engine to a group, decides on
the host which offered versions its workers load, and hands each to the searcher as a
`WorkerVersion`; data the learner still sends on the sync group is drained."""
from __future__ import annotations

import threading

from hpc_tba.comm.weight_sync.manifest import FLAG_EVAL
from hpc_tba.comm.weight_sync.staging import StreamedWeights


class WorkerVersion:
    """A version an out-of-process engine's workers are receiving from the learner themselves
    (worker_groups.py): `StreamedWeights.tensors()` of a receiver serving such an engine. The
    engine loads it (`VLLMEngine.load_weights`) and calls `done()`; `abandon()` tells the workers
    nobody will (they drain the rest)."""

    def __init__(self, version: int, slot, k: int, consumed: threading.Event):
        self.version, self.slot, self.k, self._consumed = version, slot, k, consumed

    def done(self) -> None:
        self._consumed.set()

    def abandon(self) -> None:
        self.slot.abandon(self.k)
        self.done()

    def __iter__(self):
        raise TypeError("a WorkerVersion is received by the engine's workers, not iterated here: "
                        "load it with an out-of-process VLLMEngine")


class EngineOffers:
    """`WeightReceiver`'s part for an engine whose workers receive themselves (`serve_engine`): a
    mixin on the receiver's state (`_cond`, `_latest`, `_workers`, `_drain`, ...; receiver.py)."""

    def serve_engine(self, engine) -> None:
        """From now on, an out-of-process engine's workers receive every version themselves
        (worker_groups.py); an in-process engine keeps this receiver's staging. Call it with
        every engine the searcher builds (a rebuilt one joins a fresh group)."""
        with self._cond:  # a version accepted for the previous engine's workers: gone with them
            old = self._latest
            if self._workers is not None:
                self._offer_slot = None  # the old engine's offers thread accepts nothing more
                if isinstance(old, StreamedWeights):
                    self._latest = None
                    self.skipped_versions.append(old.version)
                    old.tensors().abandon()
        join = getattr(engine, "join_weight_sync", None)
        if join is None or getattr(engine, "in_process", True):
            with self._cond:
                self._workers = None
            return
        from hpc_tba.comm.weight_sync.worker_groups import register_engine

        slot = register_engine(self.group, tp=engine.cfg.tensor_parallel_size)
        join(slot, self.manifest)
        with self._cond:
            self._workers = self._offer_slot = slot
            self.staging = "stream"  # what the workers do: the searcher's windows apply
        self._offer_thread = threading.Thread(target=self._offers, args=(slot,), daemon=True,
                                              name="engine-weight-offers")
        self._offer_thread.start()

    def _to_workers(self, version: int, flags: int, on_sync: bool, reaches: bool) -> None:
        """A version's header, to a searcher whose out-of-process engine's workers receive
        themselves: its data comes through the learner's feed for this engine (`_offers`); here
        a version that does not reach the engine (no group yet) is skipped, and data the learner
        still sent on the sync group (in-process searchers share it) is drained into one bucket."""
        if not reaches:
            self._skip([(version, flags)])
        if on_sync:
            self._drain(version, skipped=False)

    def _skip(self, versions: list[tuple[int, int]]) -> None:
        with self._cond:
            for version, flags in versions:
                self.skipped_versions.append(version)
                if flags & FLAG_EVAL:
                    self._pending_eval.append(version)  # evaluated with the next version loaded

    def _offers(self, slot) -> None:
        """The searcher's end of its engine's feed (thread, one per engine built): for each
        version offered, decide on the host whether the workers load it (the searcher takes it
        as a `WorkerVersion`) or not (busy: it is not sent), and wait until it was loaded. The
        versions the feed skipped (busy with an older one) are counted here."""
        from hpc_tba.comm.weight_sync.worker_groups import wait_offer

        store, k = slot.offers(), 0
        gone = lambda: self.stopped or self._offer_slot is not slot  # noqa: E731
        try:
            while (got := wait_offer(store, k, stop=gone)) is not None:
                version, flags, missed = got
                self._skip(missed)
                with self._cond:
                    accept = self.accepting and not gone()
                    if slot.decide(version, flags, accept) != k:
                        raise RuntimeError(f"engine weight sync: decision out of step at offer {k}")
                    if accept:
                        self._consumed.clear()
                        wv = WorkerVersion(version, slot, k, self._consumed)
                        self._latest = StreamedWeights(version, flags, lambda wv=wv: wv)
                        self._announce(version, flags)
                if accept:
                    self._consumed.wait()
                else:
                    self._skip([(version, flags)])
                k += 1
        except BaseException as e:  # surfaced to the searcher's main loop by take()
            self.error = e
            with self._cond:
                self._cond.notify_all()
