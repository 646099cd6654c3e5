"""Durable segments: exact restart, re-sharding, compaction, torn tails and a real SIGKILL."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from buffer_helpers import contents, make_batch, per_prompt, random_batch

from hpc_tba.buffer import BufferShard
from hpc_tba.buffer.log import read_manifest, shard_dir
from hpc_tba.buffer.segments import FILE_HEAD, encode_traj, read_segment
from hpc_tba.config import BufferConfig


def _cfg(**kw) -> BufferConfig:
    return BufferConfig(**{"warm_start": 0, "fsync": "never", **kw})


def _fill(shards: list[BufferShard], n_batches: int, seed: int = 0, sync_every: int = 7) -> None:
    rng = np.random.default_rng(seed)
    for i in range(n_batches):
        pid = int(rng.integers(0, 40))
        b = random_batch(rng, pid, int(rng.integers(1, 6)), vocab=4, max_len=3, version=i)
        shards[pid % len(shards)].add(b)
        if i % sync_every == 0:
            for s in shards:
                s.mark_sync(i)


def _state(shard: BufferShard) -> tuple:
    return (per_prompt(shard), shard._recent, shard._recent_prev, shard.sync_version,
            {k: v for k, v in shard.metrics().items() if k.split("/")[1] in shard.store.counters})


@pytest.mark.parametrize("capacity", [0, 60])
def test_restart_rebuilds_the_shard_exactly(tmp_path, capacity):
    cfg = _cfg(capacity=capacity, per_prompt_capacity=4, eviction="lowest_reward")
    a = BufferShard(cfg, directory=str(tmp_path), seed=1)
    _fill([a], 300)
    a.sample(3, 2, learner_version=5)
    saved, before = a.state_dict(), _state(a)
    a.close()
    b = BufferShard(cfg, directory=str(tmp_path), seed=99)
    b.load_state_dict(saved)
    assert _state(b) == before
    for _ in range(3):  # same contents and same RNG: the same batches
        x, y = a.sample(3, 2, learner_version=6), b.sample(3, 2, learner_version=6)
        assert [t.tolist() for t in x.response_tokens] == [t.tolist() for t in y.response_tokens]
    assert b.metrics()["buffer/torn_records"] == 0


def test_reshard_2_to_1_and_3_keeps_the_multiset(tmp_path):
    root = str(tmp_path / "two")
    two = [BufferShard(_cfg(), shard_id=i, num_shards=2, directory=root) for i in range(2)]
    _fill(two, 400, seed=3)
    want = contents(two)
    for s in two:
        s.close()
    shutil.copytree(root, tmp_path / "copy")
    one = [BufferShard.load(root, _cfg(), shard_id=0, num_shards=1)]
    assert contents(one) == want
    three = [BufferShard.load(str(tmp_path / "copy"), _cfg(), shard_id=i, num_shards=3)
             for i in range(3)]
    assert contents(three) == want
    for i, s in enumerate(three):
        assert all(pid % 3 == i for pid in s.store.prompts)
        s.close()
    one[0].close()
    again = [BufferShard.load(root, _cfg(), shard_id=i, num_shards=3) for i in range(3)]  # 2->1->3
    assert contents(again) == want
    for s in again:
        s.close()
    reopened = [BufferShard.load(root, _cfg(), shard_id=i, num_shards=3) for i in range(3)]
    assert contents(reopened) == want and sorted(os.listdir(root)) == [
        "g0000-n0002", "g0001-n0001", "g0002-n0003"]  # a restart does not re-import


def test_compaction_shrinks_the_log_and_replays_the_same(tmp_path):
    cfg = _cfg(capacity=50, per_prompt_capacity=3, compact_ratio=0.5)
    a = BufferShard(cfg, directory=str(tmp_path))
    _fill([a], 3000, seed=5, sync_every=50)
    m = a.metrics()
    assert m["buffer/compactions"] >= 1 and m["buffer/segments"] == 1
    assert m["buffer/logged"] < 2 * 4096  # evicted records were dropped from disk
    before = _state(a)
    a.close()
    assert _state(BufferShard(cfg, directory=str(tmp_path))) == before


def test_stray_segments_and_unfinished_imports_are_redone(tmp_path):
    root = str(tmp_path)
    a = BufferShard(_cfg(), directory=root)
    _fill([a], 100)
    want = contents([a])
    a.close()
    d = shard_dir(root, 0, 1, 0)
    with open(os.path.join(d, "seg-00000099.tbs"), "wb") as f:  # a crashed compaction's output
        f.write(b"junk")
    reopened = BufferShard(_cfg(), directory=root)
    assert contents([reopened]) == want
    assert not os.path.exists(os.path.join(d, "seg-00000099.tbs"))
    reopened.close()
    two0 = BufferShard(_cfg(), shard_id=0, num_shards=2, directory=root)
    two0.close()
    # shard 1's import "crashed": its manifest says incomplete and a partial segment exists
    d1 = shard_dir(root, 1, 2, 1)
    os.makedirs(d1)
    with open(os.path.join(d1, "MANIFEST.json"), "w") as f:
        f.write('{"format": 1, "shard_id": 1, "num_shards": 2, "gen": 1, "complete": false, '
                '"segments": ["seg-00000000.tbs"], "next_segment": 1, "compactions": 0, "base": {}}')
    shutil.copy(os.path.join(shard_dir(root, 1, 2, 0), "seg-00000000.tbs"), d1)
    shards = [BufferShard(_cfg(), shard_id=i, num_shards=2, directory=root) for i in range(2)]
    assert contents(shards) == want and read_manifest(d1)["complete"]


@pytest.mark.parametrize("damage", ["cut_payload", "cut_frame", "flip_bit", "garbage"])
def test_torn_tail_is_dropped_counted_and_appends_continue(tmp_path, damage):
    cfg = _cfg()
    a = BufferShard(cfg, directory=str(tmp_path))
    for i in range(10):
        a.add(make_batch(i, [[i, 1], [i, 2]], [0.0, 1.0], version=i))
    want = contents([a])
    a.close()
    path = os.path.join(shard_dir(str(tmp_path), 0, 1, 0), "seg-00000000.tbs")
    good = os.path.getsize(path)
    extra = encode_traj(read_segment(path).records[0])
    with open(path, "r+b") as f:
        if damage == "flip_bit":  # the last acknowledged record itself is damaged
            f.seek(good - 3)
            byte = f.read(1)
            f.seek(good - 3)
            f.write(bytes([byte[0] ^ 1]))
        else:
            f.seek(good)
            f.write({"cut_payload": extra[:-5], "cut_frame": extra[:7],
                     "garbage": b"\x00" * 100}[damage])
    b = BufferShard(cfg, directory=str(tmp_path))
    assert b.metrics()["buffer/torn_records"] == 1
    if damage == "flip_bit":
        assert len(b) == len(a) - 2 and 9 not in b.store.prompts
    else:
        assert contents([b]) == want and os.path.getsize(path) == good
    b.add(make_batch(50, [[5]], [0.0]))
    b.close()
    c = BufferShard(cfg, directory=str(tmp_path))
    assert c.metrics()["buffer/torn_records"] == 0 and 50 in c.store.prompts


CHILD = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from hpc_tba.buffer import BufferShard
    from hpc_tba.config import BufferConfig
    from hpc_tba.buffer.log import shard_dir
    from hpc_tba.buffer.segments import TrajRecord, encode_traj
    sys.path.insert(0, os.path.dirname({test!r}))
    from test_buffer_durability import child_batch
    root, tear_after, cfg = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    shard = BufferShard(BufferConfig(**cfg), directory=root)
    for i in range(10**6):
        if i == tear_after:  # simulate the kernel having taken half of the next write
            seg = os.path.join(shard_dir(root, 0, 1, 0), shard._log.manifest["segments"][-1])
            b = child_batch(i)
            frame = encode_traj(TrajRecord(b.prompt_id, b.policy_version, 0, b.timestamp, 0.0,
                                           b.prompt_tokens, b.lengths, b.rewards, None,
                                           b.response_tokens, b.logp_behavior))
            with open(seg, "ab") as f:
                f.write(frame[: len(frame) // 2])
            print("torn", flush=True)
            time.sleep(60)
        shard.add(child_batch(i))
        print(i, flush=True)  # acknowledged: add() returned
""")


def child_batch(i: int):
    """Batch i of the SIGKILL test: large enough that a kill can land inside a write."""
    rng = np.random.default_rng(i)
    return make_batch(i % 50, [[i, j] + rng.integers(0, 9, 500).tolist() for j in range(32)],
                      [float(j) for j in range(32)], version=i, timestamp=float(i))


def _kill_child(root: str, *, kill_after: int, tear_after: int, cfg: dict) -> int:
    code = CHILD.format(test=os.path.abspath(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code, root, str(tear_after), json.dumps(cfg)],
                            stdout=subprocess.PIPE, text=True, env=env)
    acked = -1
    for line in proc.stdout:
        if line.strip() == "torn" or int(line) >= kill_after:
            acked = max(acked, -1 if line.strip() == "torn" else int(line))
            break
        acked = int(line)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return acked


@pytest.mark.parametrize("mode", ["random_kill", "torn_write"])
def test_sigkill_while_appending_loses_nothing_acknowledged(tmp_path, mode):
    root = str(tmp_path)
    acked = _kill_child(root, kill_after=10**6 if mode == "torn_write" else 150,
                        tear_after=120 if mode == "torn_write" else 10**6,
                        cfg={"warm_start": 0, "fsync": "never"})
    shard = BufferShard(_cfg(), directory=root)
    recovered = sorted({int(shard.store.tok[shard.store.s["off"][s]])
                        for s in shard.store.live_slots().tolist()})
    assert recovered == list(range(len(recovered))) and len(recovered) >= acked + 1
    reference = BufferShard(_cfg())
    for i in recovered:
        reference.add(child_batch(i))
    assert per_prompt(shard) == per_prompt(reference)  # nothing else changed
    if mode == "torn_write":
        assert len(recovered) == 120 and shard.metrics()["buffer/torn_records"] == 1
        seg = os.path.join(shard_dir(root, 0, 1, 0), "seg-00000000.tbs")
        assert read_segment(seg).torn_bytes == 0 and os.path.getsize(seg) > FILE_HEAD.size


def test_segments_rotate_and_a_corrupt_middle_segment_is_reported(tmp_path):
    cfg = _cfg(segment_bytes=4096)
    a = BufferShard(cfg, directory=str(tmp_path))
    _fill([a], 200, seed=11)
    before = _state(a)
    a.close()
    d = shard_dir(str(tmp_path), 0, 1, 0)
    segs = read_manifest(d)["segments"]
    assert len(segs) > 3 and sorted(n for n in os.listdir(d) if n.endswith(".tbs")) == segs
    assert _state(BufferShard(cfg, directory=str(tmp_path))) == before
    middle = os.path.join(d, segs[1])
    size = os.path.getsize(middle)
    with open(middle, "r+b") as f:  # damage the last record of a middle segment
        f.seek(size - 2)
        f.write(b"\xff\xff")
    b = BufferShard(cfg, directory=str(tmp_path))
    assert b.metrics()["buffer/torn_records"] == 1
    assert os.path.getsize(middle) == size  # only the active (last) segment is ever truncated
    assert 0 < len(before[0]) and len(b) < sum(len(v) for v in before[0].values())


def test_sigkill_with_eviction_and_compaction_rebuilds_a_prefix(tmp_path):
    """Under a global cap evicted records vanish from disk, so recovery is checked by state:
    the reloaded shard must equal a reference fed some prefix of the messages that covers every
    acknowledged one."""
    cfg = {"warm_start": 0, "fsync": "never", "capacity": 200, "compact_ratio": 0.3}
    acked = _kill_child(str(tmp_path), kill_after=int(np.random.default_rng().integers(150, 400)),
                        tear_after=10**6, cfg=cfg)
    shard = BufferShard(BufferConfig(**cfg), directory=str(tmp_path))
    assert shard.metrics()["buffer/compactions"] >= 1
    got = per_prompt(shard)
    reference = BufferShard(BufferConfig(**{**cfg, "fsync": "interval"}))
    for i in range(acked + 1):
        reference.add(child_batch(i))
    for i in range(acked + 1, acked + 400):
        if per_prompt(reference) == got:
            break
        reference.add(child_batch(i))
    assert per_prompt(reference) == got


def test_advantages_survive_restart_and_compaction(tmp_path):
    cfg = _cfg(per_prompt_capacity=2, compact_ratio=0.2)
    a = BufferShard(cfg, directory=str(tmp_path))
    rng = np.random.default_rng(2)
    for i in range(2500):  # mixed: some messages with advantages, some without
        b = random_batch(rng, i % 30, 3, vocab=1000, version=i)
        a.add(b, advantages=b.rewards + 1 if i % 3 == 0 else None)

    def rows(shard: BufferShard) -> list:
        st, out = shard.store, []
        for slot in st.live_slots().tolist():
            o, n = int(st.s["off"][slot]), int(st.s["len"][slot])
            out.append((int(st.s["pid"][slot]), st.tok[o:o + n].tobytes(), st.logp[o:o + n].tobytes(),
                        float(np.nan_to_num(st.s["adv"][slot], nan=-99.0))))
        return out

    assert a.metrics()["buffer/compactions"] >= 1
    want = rows(a)
    assert any(r[3] != -99.0 for r in want) and any(r[3] == -99.0 for r in want)
    a.close()
    assert rows(BufferShard(cfg, directory=str(tmp_path))) == want


def _old_record_with_reference(b, *, advantages: np.ndarray) -> bytes:
    """A kind-1 record as versions before the reference log-probs left the buffer wrote it: flag
    bit 0 set and f32[T] reference log-probs after the behaviour ones."""
    import struct
    import zlib

    from hpc_tba.buffer.segments import FRAME, KIND_TRAJ, REC_MAGIC, TRAJ_HEAD

    head = TRAJ_HEAD.pack(b.prompt_id, b.policy_version, b.searcher_id, b.timestamp, b.timestamp,
                          b.lengths.size, b.prompt_tokens.size, b.response_tokens.size, 1 | 2, 0, 0)
    payload = b"".join([head, b.prompt_tokens.astype("<i4").tobytes(), b.lengths.astype("<i4").tobytes(),
                        b.rewards.astype("<f4").tobytes(), advantages.astype("<f4").tobytes(),
                        b.response_tokens.astype("<i4").tobytes(), b.logp_behavior.astype("<f4").tobytes(),
                        (2 * b.logp_behavior).astype("<f4").tobytes()])
    crc = zlib.crc32(payload, zlib.crc32(struct.pack("<II", KIND_TRAJ, len(payload))))
    return FRAME.pack(REC_MAGIC, KIND_TRAJ, len(payload), crc) + payload


def test_segments_with_reference_logprobs_from_older_versions_still_read(tmp_path):
    """Older versions stored reference log-probs (flag bit 0) that nothing read: a segment
    written by them replays exactly, the reference values skipped, and appends continue."""
    cfg = _cfg(sampler="uniform")
    a = BufferShard(cfg, directory=str(tmp_path))
    a.add(make_batch(0, [[9, 9]], [0.0]))  # creates the segment file and its manifest
    a.close()
    seg = os.path.join(shard_dir(str(tmp_path), 0, 1, 0), "seg-00000000.tbs")
    old = [make_batch(p, [[p, 1, 2], [p, 3]], [0.5, 1.0], version=p) for p in (1, 2)]
    with open(seg, "ab") as f:
        for b in old:
            f.write(_old_record_with_reference(b, advantages=b.rewards - 0.25))
    scan = read_segment(seg)
    assert scan.torn_bytes == 0 and len(scan.records) == 3
    rec = scan.records[1]
    assert rec.response_tokens.tolist() == [1, 1, 2, 1, 3] and rec.advantages.tolist() == [0.25, 0.75]
    assert rec.logp_behavior.tobytes() == old[0].logp_behavior.tobytes()
    b = BufferShard(cfg, directory=str(tmp_path))
    want = BufferShard(cfg)
    want.add(make_batch(0, [[9, 9]], [0.0]))
    for x in old:
        want.add(x, advantages=x.rewards - 0.25)
    assert contents([b]) == contents([want])
    b.add(make_batch(3, [[4]], [1.0]))
    b.close()
    assert len(BufferShard(cfg, directory=str(tmp_path))) == 6


def test_checkpoint_offsets_expose_lost_unsynced_bytes(tmp_path, caplog):
    a = BufferShard(_cfg(), directory=str(tmp_path))
    _fill([a], 50)
    saved = a.state_dict()
    a.close()
    seg = os.path.join(shard_dir(str(tmp_path), 0, 1, 0), "seg-00000000.tbs")
    scan = read_segment(seg)
    with open(seg, "r+b") as f:  # e.g. a power cut under fsync=never dropped the last records
        f.truncate(scan.valid_end - 200)
    b = BufferShard(_cfg(), directory=str(tmp_path))
    b.load_state_dict(saved)
    assert b.metrics()["buffer/torn_bytes"] >= 200 and "checkpoint saw" in caplog.text
