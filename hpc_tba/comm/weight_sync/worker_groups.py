"""Out-of-process engines' workers join the learner's weight broadcast themselves (issue 24).

Per searcher whose engine runs out of process (`searcher.engine_process`, tensor parallelism), a
small **engine group** of learner rank 0 and the engine's TP workers (ranks 1..TP), built on the
sync group's TCPStore under a prefix of its own (`hpc_tba/engines/<searcher>/<generation>`), so
the searcher's process holds no weights (and on GPU opens no CUDA context on the engine's GPUs):
each worker receives every bucket straight from the learner and loads it into its own shard. The
backend is the sync group's (gloo on CPU, NCCL on GPU: the same code).

Rendezvous, all on the host:

- the searcher registers its engine (`register_engine`): key `hpc_tba/engines/<i>` = "gen,tp",
  a fresh generation per engine built (a rebuilt engine gets a fresh group; the learners' sync
  group is never touched), and its workers start joining the group in a background thread;
- learner rank 0 (`EngineGroups.refresh`, at the start of every `send`) sees a new registration,
  builds its end of that group in a thread (it never waits more than `join_wait_s` for an engine),
  starts that group's **feed** (feeds.py: it broadcasts held copies of versions at the engine's
  pace) and names, in the version's header, the generation of every engine group it feeds;
- per version the feed sends, it posts an offer (`post_offer`: key `.../offer/<k>` =
  "version,flags,missed versions and their flags"); the searcher posts its decision
  (`EngineSlot.decide`: key `.../decide/<k>` = "version,flags,accept"): the workers load it
  (accept) or nothing is sent (skip: the searcher is busy with a round). Workers and feed read it
  on the host before any broadcast is posted, so no receive is pending on an engine group between
  syncs either.

A broadcast to an engine whose process died fails in its feed (gloo: the connection closes);
that group and feed are dropped (`EngineGroups.failed`) and the learner never notices; the
rebuilt engine registers a new generation, which gets a fresh group and feed. On NCCL a dead
peer is only seen at the group's timeout (GROUP_TIMEOUT_S).
"""
from __future__ import annotations

import datetime
import threading
import time

import torch

from hpc_tba.comm.weight_sync.group import GROUP_TIMEOUT_S, _store_of, drop_read_keys

_REG = "hpc_tba/engines/{}"
_GEN = "hpc_tba/engines/{}/generations"
_PREFIX = "hpc_tba/engines/{}/{}"  # a PrefixStore adds the "/"
_OFFER = "offer/{}"
_DECIDE = "decide/{}"
_DECIDE_READ = "decide_read/{}"
_ABANDON = "abandon/{}"
JOIN_WAIT_S = 10.0
"""How long learner rank 0 waits, at a sync, for a group an engine registered since the last one
(its workers are already waiting: milliseconds); past that the version misses that engine."""


def _backend(pg) -> str:
    import torch.distributed as dist

    return "gloo" if isinstance(pg, dist.ProcessGroupGloo) else "nccl"


def _client(store):
    """A connection of its own to the sync group's store: a TCPStore client serializes its
    operations, and the receiver's thread sits in a blocking `wait` for the next header (up to a
    minute), which would hold every registration or decision made on the same connection."""
    import torch.distributed as dist

    return dist.TCPStore(store.host, store.port, is_master=False,
                         timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def build_group(store, rank: int, size: int, backend: str, timeout_s: float = GROUP_TIMEOUT_S):
    """A process group on `store` (a PrefixStore): gloo or NCCL, the same timeout for both."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"engine weight group: backend {backend!r} is not gloo or nccl")


class EngineSlot:
    """The searcher's handle on its engine's group (what the workers need to join it, and the
    decisions it posts for every version that goes to them)."""

    def __init__(self, store, *, index: int, gen: int, tp: int, host: str, port: int, backend: str):
        self.store, self.index, self.gen, self.tp = store, index, gen, tp
        self.host, self.port, self.backend = host, port, backend
        self.prefix = _PREFIX.format(index, gen)
        self._k = self._oldest = 0

    def join_args(self) -> dict:
        """What every worker passes to `join_store` (plain values: they go through an RPC)."""
        return {"host": self.host, "port": self.port, "prefix": self.prefix,
                "size": 1 + self.tp, "backend": self.backend}

    def offers(self):
        """A store client of this engine group's own (under its prefix), for the thread that waits
        for the feed's offers (a client serializes its operations: `decide` and `abandon` go on
        `self.store` meanwhile)."""
        import torch.distributed as dist

        return dist.PrefixStore(self.prefix, _client(self.store))

    def decide(self, version: int, flags: int, accept: bool) -> int:
        """Tell the workers (and the learner's feed) whether the version offered k-th is loaded
        (accept) or not sent at all (skip: the searcher is busy); returns k.
        A decision's key goes once every worker has read it (each counts itself): that a
        version's broadcasts completed on the learner does not mean every worker read its
        decision (gloo's sends complete once buffered)."""
        k, self._k = self._k, self._k + 1
        self.store.set(f"{self.prefix}/{_DECIDE.format(k)}", f"{version},{flags},{int(accept)}")
        # read by every worker and by the learner's feed
        self._oldest = drop_read_keys(self.store, self._oldest, k, self.tp + 1,
                                      lambda i: f"{self.prefix}/{_DECIDE.format(i)}",
                                      lambda i: f"{self.prefix}/{_DECIDE_READ.format(i)}")
        return k

    def abandon(self, k: int) -> None:
        """An accepted version nobody will load (the searcher stops): the workers drain the rest."""
        self.store.set(f"{self.prefix}/{_ABANDON.format(k)}", "1")


def register_engine(pg, *, tp: int) -> EngineSlot:
    """Searcher side: announce an engine of `tp` workers on the sync group's store (a fresh
    generation); its workers then join with `join_store` + `build_group(rank=1 + tp rank)`."""
    store = _client(_store_of(pg)[0])
    index = pg.rank() - 1
    gen = int(store.add(_GEN.format(index), 1)) - 1
    slot = EngineSlot(store, index=index, gen=gen, tp=tp, host=store.host, port=store.port,
                      backend=_backend(pg))
    store.set(_REG.format(index), f"{gen},{tp}")
    return slot


def join_store(host: str, port: int, prefix: str, timeout_s: float = GROUP_TIMEOUT_S):
    """A worker's client of the sync group's store, under its engine group's prefix."""
    import torch.distributed as dist

    base = dist.TCPStore(host, port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, base), base


def _wait_key(store, key: str, poll_s: float, stop) -> bool:
    """Block on the host until `key` is set (True), polling `stop()` every `poll_s` (False)."""
    while True:
        try:
            store.wait([key], datetime.timedelta(seconds=poll_s))
            return True
        except torch.distributed.DistStoreError as e:
            if "timeout" not in str(e):
                raise
            if stop is not None and stop():
                return False


def wait_decision(store, k: int, *, poll_s: float = 1.0, stop=None) -> tuple[int, int, bool] | None:
    """A worker, or the learner's feed: block on the host until decision k is posted (None once
    `stop()` is true)."""
    key = _DECIDE.format(k)
    if not _wait_key(store, key, poll_s, stop):
        return None
    version, flags, accept = (int(x) for x in store.get(key).decode().split(","))
    store.add(_DECIDE_READ.format(k), 1)  # read: the searcher may drop the key
    return version, flags, bool(accept)


def post_offer(store, k: int, version: int, flags: int, missed: list[tuple[int, int]]) -> None:
    """Learner rank 0's feed: offer k is `version` (`flags`); `missed`: (version, flags) of every
    version sent since its last offer that this engine never gets (the feed was busy)."""
    ints = [version, flags] + [x for vf in missed for x in vf]
    store.set(_OFFER.format(k), ",".join(str(int(x)) for x in ints))


def wait_offer(store, k: int, *, poll_s: float = 1.0, stop=None
               ) -> tuple[int, int, list[tuple[int, int]]] | None:
    """The searcher: block on the host until offer k is posted (None once `stop()` is true);
    returns (version, flags, missed). The feed deletes the key once the decision is read."""
    key = _OFFER.format(k)
    if not _wait_key(store, key, poll_s, stop):
        return None
    ints = [int(x) for x in store.get(key).decode().split(",")]
    return ints[0], ints[1], list(zip(ints[2::2], ints[3::2]))


def drop_offer(store, k: int) -> None:
    """The feed, once it read decision k (the searcher read offer k before deciding)."""
    store.delete_key(_OFFER.format(k))


def abandoned(store, k: int) -> bool:
    return bool(store.check([_ABANDON.format(k)]))


class EngineGroups:
    """Learner rank 0's end of every engine group: one per searcher whose engine registered,
    replaced when that engine is rebuilt (a new generation), each with its feed: `feed(searcher,
    generation, group, store, on_failure)` starts one (the sender's: feeds.Feed over its held
    copies; None: no feeds)."""

    def __init__(self, pg, *, feed=None, join_wait_s: float = JOIN_WAIT_S):
        self.pg, self.store = pg, _client(_store_of(pg)[0])
        self.searchers = pg.size() - 1
        self.backend = _backend(pg)
        self.make_feed = feed
        self.join_wait_s = join_wait_s
        self._lock = threading.Lock()  # feeds report failures from their threads
        self._groups: dict[int, tuple[int, object]] = {}  # searcher -> (gen, group)
        self._feeds: dict[int, object] = {}  # searcher -> its group's Feed
        self._building: dict[int, tuple[int, threading.Thread, dict]] = {}  # groups being joined
        self._dead: set[tuple[int, int]] = set()  # (searcher, gen) whose broadcast failed
        self.registered: set[int] = set()
        self.failures: list[str] = []

    def refresh(self) -> list[int]:
        """The generation of each searcher's engine group this version goes to (-1: none); a
        group joined since the last call gets its feed, which considers versions from the next
        one the sender holds on."""
        for i in range(self.searchers):
            key = _REG.format(i)
            if not self.store.check([key]):
                continue
            self.registered.add(i)
            gen, tp = (int(x) for x in self.store.get(key).decode().split(","))
            have = self._groups.get(i, (-1, None))[0]
            if (gen > have and (i, gen) not in self._dead
                    and self._building.get(i, (-1,))[0] != gen):
                self._start(i, gen, tp)
        for i, (gen, thread, out) in list(self._building.items()):
            thread.join(max(0.0, out["deadline"] - time.monotonic()))  # once: at most join_wait_s
            if thread.is_alive():
                continue  # still joining: a later version reaches it
            del self._building[i]
            if "pg" in out:
                self._joined(i, gen, out["pg"])
            else:
                self.failures.append(f"searcher {i} engine group {gen}: {out.get('error')}")
        with self._lock:
            return [self._groups[i][0] if i in self._groups else -1 for i in range(self.searchers)]

    def _joined(self, i: int, gen: int, pg) -> None:
        import torch.distributed as dist

        feed = None
        if self.make_feed is not None:  # its own store client: it blocks on the searcher's decisions
            store = dist.PrefixStore(_PREFIX.format(i, gen), _client(self.store))
            feed = self.make_feed(i, gen, pg, store, self._failed)
        with self._lock:
            self._groups[i] = (gen, pg)
            old = self._feeds.pop(i, None)
            if feed is not None:
                self._feeds[i] = feed
        if old is not None:  # the previous engine's: it ends at its next poll or failed send
            old.request_stop()

    def _start(self, i: int, gen: int, tp: int) -> None:
        import torch.distributed as dist

        out: dict = {"deadline": time.monotonic() + self.join_wait_s}
        store = dist.PrefixStore(_PREFIX.format(i, gen), _client(self.store))  # its own waits

        def build() -> None:
            try:
                out["pg"] = build_group(store, 0, 1 + tp, self.backend)
            except BaseException as e:  # noqa: BLE001 - recorded; that engine misses versions
                out["error"] = e

        t = threading.Thread(target=build, name=f"engine-group-{i}-{gen}", daemon=True)
        t.start()
        self._building[i] = (gen, t, out)

    def groups(self) -> list[tuple[int, object]]:
        """(searcher, group) of every engine group that is joined."""
        with self._lock:
            return [(i, pg) for i, (_, pg) in sorted(self._groups.items())]

    def feeds(self) -> list:
        """The feed of every joined engine group."""
        with self._lock:
            return [f for _, f in sorted(self._feeds.items())]

    @property
    def all_registered(self) -> bool:
        """Every searcher's engine is out of process: the sync group carries no data."""
        return len(self.registered) == self.searchers

    def _failed(self, feed, error: BaseException) -> None:
        """A feed's broadcast failed: its engine died."""
        with self._lock:
            if self._feeds.get(feed.index) is not feed:
                return  # already replaced by a rebuilt engine's
        self.failed(feed.index, error)

    def failed(self, i: int, error: BaseException) -> None:
        """A broadcast to searcher i's engine failed (its process died): drop the group (the
        rebuilt engine registers a new generation, which gets a fresh group and feed)."""
        with self._lock:
            gen, pg = self._groups.pop(i, (-1, None))
            feed = self._feeds.pop(i, None)
            self._dead.add((i, gen))
        if feed is not None:
            feed.request_stop()
        self.failures.append(f"searcher {i} engine group {gen}: {type(error).__name__}: {error}")
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - an already broken group
                pass

    def stop(self) -> None:
        """Stop every feed (each after the version it is broadcasting, if any)."""
        for feed in self.feeds():
            feed.request_stop()
        for feed in self.feeds():
            feed.stop()
