"""On-disk format of buffer segments: checksummed, append-only records, no pickle.

A segment file is a 16-byte header followed by records, all little-endian:

    file header  8s  magic b"TBASEG1\\n"
                 u32 shard_id, u32 num_shards        (layout that wrote it; informational)
    record       u32 magic 0x52414254 ("TBAR")
                 u32 kind                            1 = trajectories, 2 = weight sync
                 u32 payload_len
                 u32 crc32 of (kind, payload_len, payload)
                 payload_len bytes of payload

    kind 1 payload (the responses of ONE prompt that the shard accepted in one add):
                 i64 prompt_id, i64 policy_version, i64 searcher_id,
                 f64 timestamp (generation), f64 accept_time (when the shard took it),
                 u32 n (responses), u32 P (prompt tokens), u32 T (response tokens),
                 u32 flags (bit 1: advantages present, bit 2: per-token weight versions
                 present; bit 0: reference log-probs present, written by older versions only,
                 read past and dropped: the learner computes the reference itself),
                 u32 duplicates dropped inside the batch, u32 responses over the per-prompt cap
                 (neither is stored; the counts keep buffer/duplicates exact across restarts)
                 i32[P] prompt tokens, i32[n] lengths, f32[n] rewards, f32[n] advantages (bit 1),
                 i32[T] response tokens, f32[T] behaviour log-probs, f32[T] ref log-probs (bit 0, older segments),
                 i32[T] the weight version of each token (bit 2; else policy_version for all)
    kind 2 payload: i64 version, f64 time        (mark_sync was called; rebuilds "recent")

A record is valid only if its magic, length and CRC all check out. Readers stop at the first
invalid record: what follows is a torn tail (a crash in the middle of a write) and is dropped and
reported, never parsed. Records are written with one `write` call each, so a killed process can
leave at most one partial record, at the very end.
"""
from __future__ import annotations

import dataclasses
import os
import struct
import zlib
from collections.abc import Iterator

import numpy as np

FILE_MAGIC = b"TBASEG1\n"
FILE_HEAD = struct.Struct("<8sII")
REC_MAGIC = 0x52414254
FRAME = struct.Struct("<IIII")
TRAJ_HEAD = struct.Struct("<qqqddIIIIII")
SYNC = struct.Struct("<qd")
KIND_TRAJ, KIND_SYNC = 1, 2
_OLD_REF, _HAS_ADV, _HAS_VER = 1, 2, 4


@dataclasses.dataclass
class TrajRecord:
    """One decoded kind-1 record; arrays are read-only views into the segment bytes."""

    prompt_id: int
    policy_version: int
    searcher_id: int
    timestamp: float
    accept_time: float
    prompt_tokens: np.ndarray
    lengths: np.ndarray
    rewards: np.ndarray
    advantages: np.ndarray | None
    response_tokens: np.ndarray
    logp_behavior: np.ndarray
    dropped_duplicates: int = 0
    dropped_over_cap: int = 0
    token_versions: np.ndarray | None = None
    """Per-token weight versions (in-flight updates); None: policy_version for every token."""


@dataclasses.dataclass
class SyncRecord:
    version: int
    time: float


Record = TrajRecord | SyncRecord


def file_header(shard_id: int, num_shards: int) -> bytes:
    return FILE_HEAD.pack(FILE_MAGIC, shard_id, num_shards)


def _frame(kind: int, payload: bytes) -> bytes:
    head = struct.pack("<II", kind, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return FRAME.pack(REC_MAGIC, kind, len(payload), crc) + payload


def encode_traj(r: TrajRecord) -> bytes:
    """Frame one trajectory record (see the module docstring for the layout)."""
    flags = (_HAS_ADV if r.advantages is not None else 0) | (_HAS_VER if r.token_versions is not None else 0)
    head = TRAJ_HEAD.pack(r.prompt_id, r.policy_version, r.searcher_id, r.timestamp, r.accept_time,
                          r.lengths.size, r.prompt_tokens.size, r.response_tokens.size, flags,
                          r.dropped_duplicates, r.dropped_over_cap)
    parts = [head, _le(r.prompt_tokens, "<i4"), _le(r.lengths, "<i4"), _le(r.rewards, "<f4")]
    if r.advantages is not None:
        parts.append(_le(r.advantages, "<f4"))
    parts += [_le(r.response_tokens, "<i4"), _le(r.logp_behavior, "<f4")]
    if r.token_versions is not None:
        parts.append(_le(r.token_versions, "<i4"))
    return _frame(KIND_TRAJ, b"".join(parts))


def encode_sync(version: int, time: float) -> bytes:
    return _frame(KIND_SYNC, SYNC.pack(version, time))


def _le(a: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def decode(kind: int, payload: memoryview) -> Record:
    """Decode a checksummed payload; raises ValueError if its sizes are inconsistent."""
    if kind == KIND_SYNC:
        return SyncRecord(*SYNC.unpack(payload))
    if kind != KIND_TRAJ:
        raise ValueError(f"unknown record kind {kind}")
    pid, ver, sid, ts, acc, n, p, t, flags, dups, over = TRAJ_HEAD.unpack_from(payload)
    sizes = [("<i4", p), ("<i4", n), ("<f4", n), ("<f4", n if flags & _HAS_ADV else 0),
             ("<i4", t), ("<f4", t), ("<f4", t if flags & _OLD_REF else 0),
             ("<i4", t if flags & _HAS_VER else 0)]
    if TRAJ_HEAD.size + 4 * sum(s for _, s in sizes) != len(payload):
        raise ValueError("trajectory record sizes do not add up")
    arrays, off = [], TRAJ_HEAD.size
    for dtype, size in sizes:
        arrays.append(np.frombuffer(payload, dtype=dtype, count=size, offset=off))
        off += 4 * size
    prompt, lens, rew, adv, toks, logp, _, tver = arrays  # an older segment's ref log-probs: dropped
    return TrajRecord(pid, ver, sid, ts, acc, prompt, lens, rew, adv if flags & _HAS_ADV else None,
                      toks, logp, dups, over, tver if flags & _HAS_VER else None)


@dataclasses.dataclass
class SegmentScan:
    """Result of reading one segment: its valid records and what was torn off the end."""

    records: list[Record]
    valid_end: int
    size: int

    @property
    def torn_bytes(self) -> int:
        return self.size - self.valid_end


def read_segment(path: str) -> SegmentScan:
    """Read every valid record of a segment, stopping at the first torn or corrupt one."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < FILE_HEAD.size or data[:8] != FILE_MAGIC:
        return SegmentScan([], 0, len(data))  # header itself torn: nothing in it was acknowledged
    records = []
    end = FILE_HEAD.size
    for off, kind, payload in _frames(memoryview(data), end):
        try:
            records.append(decode(kind, payload))
        except (ValueError, struct.error):
            break
        end = off
    return SegmentScan(records, end, len(data))


def _frames(view: memoryview, off: int) -> Iterator[tuple[int, int, memoryview]]:
    """(end offset, kind, payload) of each record whose frame and CRC check out."""
    while off + FRAME.size <= len(view):
        magic, kind, length, crc = FRAME.unpack_from(view, off)
        end = off + FRAME.size + length
        if magic != REC_MAGIC or end > len(view):
            return
        payload = view[off + FRAME.size:end]
        if zlib.crc32(payload, zlib.crc32(struct.pack("<II", kind, length))) != crc:
            return
        yield end, kind, payload
        off = end


def write_all(fd: int, data: bytes) -> None:
    """One write call in the normal case; loops only if the OS writes short."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
