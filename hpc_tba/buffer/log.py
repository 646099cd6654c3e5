"""A shard's durable log: segment files, a manifest, re-sharding and compaction.

Directory layout under the run's buffer root (shared by all shards):

    g0000-n0002/shard-0000/MANIFEST.json, seg-00000000.tbs, seg-00000001.tbs, ...
    g0000-n0002/shard-0001/...
    g0001-n0003/shard-0000/...      a later run with 3 learner ranks

A *generation* `gG-nN` is one shard layout. A shard opens the newest generation; if its N differs
from the shard's, it starts generation G+1 and *imports*: it reads every shard of generation G,
keeps the records of the prompts it now owns (prompt_id % num_shards == shard_id), merged across
the old shards by accept time, and re-logs them in its own segments. The import is marked done in
the manifest only after it is written and fsynced; a crash during it redoes it. Old generations are
read, never modified.

MANIFEST.json (replaced atomically: write, fsync, rename) lists the live segments in order, whether
the shard is complete, how many compactions ran, the counters that compaction folded away, and the
BufferConfig last used (capacities decide what a replay keeps; tools read it from here).
Segment files not in the manifest are leftovers of a crashed rotation or compaction and are deleted.

Compaction rewrites the live responses in order (with the sync markers at the same positions) into
one new segment, switches the manifest to it, then deletes the old segments; replaying the result
gives the same contents and counters. It runs once evicted responses exceed `compact_ratio` of
those logged. One approximation: a prompt all of whose responses added since the latest sync were
evicted again (possible under lowest-reward eviction) is no longer "recent" after a compaction.

Durability: every record reaches the OS with one write() before `add` returns, so a killed process
loses nothing acknowledged; `fsync` (always / interval / never, then on flush and close) bounds
what a machine crash or power cut can lose. `check_offsets` reports any such loss on resume.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from hpc_tba.buffer.segments import (
    Record,
    SyncRecord,
    TrajRecord,
    encode_sync,
    encode_traj,
    file_header,
    read_segment,
    write_all,
)
from hpc_tba.config import BufferConfig

if TYPE_CHECKING:
    from hpc_tba.buffer.storage import Store

log = logging.getLogger(__name__)
_GEN = re.compile(r"^g(\d{4})-n(\d{4})$")
_MIN_COMPACT = 4096  # responses logged before compaction is considered


def generations(root: str) -> list[tuple[int, int]]:
    """(generation, num_shards) of each layout under a buffer root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [_GEN.match(d) for d in os.listdir(root)]
    return sorted((int(m.group(1)), int(m.group(2))) for m in found if m)


def shard_dir(root: str, gen: int, num_shards: int, shard_id: int) -> str:
    return os.path.join(root, f"g{gen:04d}-n{num_shards:04d}", f"shard-{shard_id:04d}")


def read_manifest(path: str) -> dict | None:
    try:
        with open(os.path.join(path, "MANIFEST.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


class ShardLog:
    """Append-only segment log of one shard (see the module docstring).

    The shard appends frames and replays records; compaction and the end of replay read the
    shard's contents through its `storage.Store` (live slots, counters, sync marks), passed in,
    so the log never imports the shard."""

    def __init__(self, root: str, cfg: BufferConfig, *, shard_id: int, num_shards: int) -> None:
        self.cfg = cfg
        gens = generations(root)
        gen, self.source = 0, None
        if gens and gens[-1][1] == num_shards:
            gen = gens[-1][0]
            self.source = gens[-2] if len(gens) > 1 else None
        elif gens:
            gen, self.source = gens[-1][0] + 1, gens[-1]
        self.root, self.dir = root, shard_dir(root, gen, num_shards, shard_id)
        os.makedirs(self.dir, exist_ok=True)
        manifest = read_manifest(self.dir)
        self.importing = (manifest is None or not manifest["complete"]) and self.source is not None
        if manifest is None or self.importing:
            manifest = {"format": 1, "shard_id": shard_id, "num_shards": num_shards, "gen": gen,
                        "complete": not self.importing, "segments": [], "next_segment": 0,
                        "compactions": 0, "base": {}}
            self._remove_strays(keep=())
            self._write_manifest(manifest)
        if manifest.get("config") != dataclasses.asdict(cfg):  # what replay and tools use
            manifest["config"] = dataclasses.asdict(cfg)
            self._write_manifest(manifest)
        self.manifest = manifest
        self._remove_strays(keep=manifest["segments"])
        self.fd: int | None = None
        self.active_bytes = 0
        self.replaying = True
        self.logged = 0  # responses in the live segments (alive or not)
        self.torn_records = self.torn_bytes = 0
        self._last_fsync = time.monotonic()

    # ---------------------------------------------------------------- replay
    def replay(self, shard_id: int, num_shards: int) -> Iterator[Record]:
        """Every valid record this shard must apply, in order (own log, or an import)."""
        if self.importing:
            yield from self._import(shard_id, num_shards)
            return
        segs = self.manifest["segments"]
        for i, name in enumerate(segs):
            path = os.path.join(self.dir, name)
            scan = read_segment(path)
            if scan.torn_bytes:
                self._torn(path, scan.torn_bytes, last=i == len(segs) - 1)
                if i == len(segs) - 1:
                    self._truncate(path, scan.valid_end)
            for rec in scan.records:
                self.logged += rec.lengths.size if isinstance(rec, TrajRecord) else 0
                yield rec

    def _import(self, shard_id: int, num_shards: int) -> Iterator[Record]:
        gen, n = self.source
        streams = []
        for s in range(n):
            src = shard_dir(self.root, gen, n, s)
            m = read_manifest(src)
            if m is None or not m["complete"]:
                raise RuntimeError(f"cannot re-shard: {src} never finished importing its own data "
                                   f"(restart with num_shards={n} once, then change it)")
            streams.append(self._source_records(src, m["segments"], s))
        for _, _, rec in heapq.merge(*streams):
            if isinstance(rec, SyncRecord) or rec.prompt_id % num_shards == shard_id:
                yield rec

    def _source_records(self, src: str, segs: list[str], s: int) -> Iterator[tuple]:
        seq = 0
        for i, name in enumerate(segs):
            scan = read_segment(os.path.join(src, name))
            if scan.torn_bytes:
                self._torn(os.path.join(src, name), scan.torn_bytes, last=i == len(segs) - 1)
            for rec in scan.records:
                t = rec.time if isinstance(rec, SyncRecord) else rec.accept_time
                seq += 1
                yield (t, s, seq), seq, rec

    def _torn(self, path: str, nbytes: int, *, last: bool) -> None:
        self.torn_records += 1
        self.torn_bytes += nbytes
        where = "torn tail (crash during a write)" if last else "CORRUPT segment middle"
        log.warning("buffer: dropped %d bytes of %s in %s", nbytes, where, path)

    def _truncate(self, path: str, valid_end: int) -> None:
        with open(path, "r+b") as f:
            if valid_end == 0:  # even the file header was torn: rewrite it
                f.truncate(0)
                f.write(file_header(self.manifest["shard_id"], self.manifest["num_shards"]))
            else:
                f.truncate(valid_end)
            f.flush()
            os.fsync(f.fileno())

    def finish_replay(self, store: Store) -> None:
        """End of replay: fold compaction counters back in, seal an import, maybe compact."""
        self.replaying = False
        for k, v in self.manifest.get("base", {}).items():
            store.counters[k] = store.counters.get(k, 0) + v
        if self.importing:
            self.flush()
            self.manifest["complete"] = True
            self._write_manifest(self.manifest)
            self.importing = False
        self.maybe_compact(store)

    # ---------------------------------------------------------------- appending
    def append(self, frame: bytes, responses: int = 0) -> None:
        """Write one framed record with one write call; fsync per the config's policy."""
        if self.fd is None:
            self._open_active()
        write_all(self.fd, frame)
        self.active_bytes += len(frame)
        self.logged += responses
        policy = self.cfg.fsync
        now = time.monotonic()
        if policy == "always" or (policy == "interval"
                                  and now - self._last_fsync >= self.cfg.fsync_interval_s):
            os.fsync(self.fd)
            self._last_fsync = now
        if self.active_bytes >= self.cfg.segment_bytes:
            self.close()  # the next append starts a new segment

    def _open_active(self) -> None:
        segs = self.manifest["segments"]
        path = os.path.join(self.dir, segs[-1]) if segs else None
        if path is None or os.path.getsize(path) >= self.cfg.segment_bytes:
            path = self._new_segment()
            self.manifest["segments"].append(os.path.basename(path))
            self._write_manifest(self.manifest)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.active_bytes = os.path.getsize(path)

    def _new_segment(self) -> str:
        """Create an empty segment (header only, fsynced); not live until a manifest lists it."""
        k = self.manifest["next_segment"]
        self.manifest["next_segment"] = k + 1
        path = os.path.join(self.dir, f"seg-{k:08d}.tbs")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, file_header(self.manifest["shard_id"], self.manifest["num_shards"]))
            os.fsync(fd)
        finally:
            os.close(fd)
        return path

    def flush(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)
            self._last_fsync = time.monotonic()

    def close(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None

    # ---------------------------------------------------------------- compaction
    def maybe_compact(self, store: Store) -> None:
        ratio = self.cfg.compact_ratio
        if self.replaying or ratio <= 0 or self.logged < _MIN_COMPACT:
            return
        if self.logged - store.copies > ratio * self.logged:  # copies: what the live frames hold
            self.compact(store)

    def compact(self, store: Store) -> None:
        """Rewrite the live responses into one new segment and drop the old ones."""
        self.close()
        path = self._new_segment()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            chunk: list[bytes] = []
            for frame in live_frames(store):
                chunk.append(frame)
                if len(chunk) >= 256:
                    write_all(fd, b"".join(chunk))
                    chunk = []
            write_all(fd, b"".join(chunk))
            os.fsync(fd)
        finally:
            os.close(fd)
        base = dict(store.counters)
        base["added"] -= store.alive  # replaying the compacted log re-adds exactly the live ones
        base["duplicates"] -= store.copies - store.alive  # ... and merges their copies again
        old = self.manifest["segments"]
        self.manifest.update(segments=[os.path.basename(path)], base=base,
                             compactions=self.manifest["compactions"] + 1)
        self._write_manifest(self.manifest)
        for name in old:
            os.remove(os.path.join(self.dir, name))
        self.logged = store.copies

    # ---------------------------------------------------------------- bookkeeping
    def offsets(self) -> dict:
        segs = self.manifest["segments"]
        return {"dir": os.path.relpath(self.dir, self.root), "compactions": self.manifest["compactions"],
                "segments": [[n, os.path.getsize(os.path.join(self.dir, n))] for n in segs]}

    def check_offsets(self, saved: dict) -> None:
        """Warn (and count) if a segment is shorter than when the checkpoint was taken."""
        if saved["dir"] != os.path.relpath(self.dir, self.root) \
                or saved["compactions"] != self.manifest["compactions"]:
            return  # re-sharded or compacted since: offsets no longer comparable
        for name, size in saved["segments"]:
            path = os.path.join(self.dir, name)
            have = os.path.getsize(path) if os.path.exists(path) else 0
            if have < size:
                self.torn_bytes += size - have
                log.warning("buffer: %s holds %d bytes but the checkpoint saw %d; records written "
                            "before the checkpoint were lost (fsync policy %r)",
                            path, have, size, self.cfg.fsync)

    def stats(self) -> dict[str, int]:
        segs = self.manifest["segments"]
        size = sum(os.path.getsize(os.path.join(self.dir, n)) for n in segs
                   if os.path.exists(os.path.join(self.dir, n)))
        return {"torn_records": self.torn_records, "torn_bytes": self.torn_bytes,
                "segments": len(segs), "log_bytes": size, "logged": self.logged,
                "compactions": self.manifest["compactions"]}

    def _write_manifest(self, manifest: dict) -> None:
        tmp = os.path.join(self.dir, "MANIFEST.json.tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.dir, "MANIFEST.json"))
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _remove_strays(self, keep: list[str] | tuple[()]) -> None:
        for name in os.listdir(self.dir):
            if name.endswith(".tbs") and name not in keep:
                os.remove(os.path.join(self.dir, name))


def live_frames(st: Store) -> Iterator[bytes]:
    """Frames that replay to the shard's current contents: live responses in order, grouped
    into one record per run of (prompt, version, searcher, times), sync markers in place."""
    live = st.live_slots()
    s = st.s
    cols = [s[k][live] for k in ("pid", "version", "searcher", "time", "accept")]
    cut = np.zeros(live.size, dtype=bool)
    if live.size:
        cut[0] = True
        for c in cols:
            cut[1:] |= c[1:] != c[:-1]
    marks = [(int(np.searchsorted(live, b)), v) for b, v in zip(st.marks, st.syncs)]
    for p, _ in marks:
        if p < live.size:
            cut[p] = True
    starts = np.flatnonzero(cut).tolist() + [live.size]
    for a, b in itertools.pairwise(starts):
        for p, (version, t) in marks:
            if p == a:
                yield encode_sync(version, t)
        yield encode_traj(_record(st, live[a:b]))
    for p, (version, t) in marks:
        if p >= live.size:
            yield encode_sync(version, t)


def _record(st: Store, slots: np.ndarray) -> TrajRecord:
    slots = st.with_copies(slots)  # duplicates=count: a slot's copies, which a replay merges again
    s, i = st.s, int(slots[0])
    idx = st.gather_index(slots)
    adv = s["adv"][slots]
    pid = int(s["pid"][i])
    return TrajRecord(pid, int(s["version"][i]), int(s["searcher"][i]), float(s["time"][i]),
                      float(s["accept"][i]), st.prompts[pid].tokens, s["len"][slots],
                      s["reward"][slots], None if np.isnan(adv).all() else adv, st.tok[idx],
                      st.logp[idx], token_versions=st.ver[idx] if st.ver.size else None)
