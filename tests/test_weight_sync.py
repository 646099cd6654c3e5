"""Weight sync: manifest bucketing, and real gloo runs of one or two ZeRO-3 learners sending to
two receivers.

The learners hold a ZeRO-3 module (deepspeed.zero.Init on a world of one or two learners), so
`send` goes through the real ZeRO-3 shards (direct gather) or GatheredParameters; the sync group
(learner rank 0 + the receivers) is the standalone gloo group of `new_group`, and a second small
gloo group (every process) carries the test's own handshakes.
"""
import json
import os

import pytest
import torch
from conftest import spawn_ranks

from hpc_tba.comm.groups import free_ports
from hpc_tba.comm.weight_sync import FLAG_EVAL, Manifest, wire_dtype_name

SHAPES = [("embed.weight", (64, 16)), ("layers.0.attn.weight", (16, 16)), ("layers.0.norm", (16,)),
          ("layers.1.attn.weight", (16, 16)), ("layers.1.norm", (16,)), ("head.weight", (64, 16))]
ODD_SHAPES = [("embed.weight", (63, 16)), ("layers.0.attn.weight", (13, 23)), ("layers.0.norm", (15,)),
              ("layers.1.attn.weight", (13, 13)), ("layers.1.norm", (15,)), ("head.weight", (63, 16))]
"""Odd sizes: over two learners the four middle parameters' ZeRO-3 partitions end in zero
padding, which the direct gather's all-gather writes past the parameter's end. They share one
2048 B bucket, and 13 x 23 = 299 fp32 values end one element before the second 600 B piece's
end: that piece may go only once the next parameter has overwritten the padding."""


def test_manifest_buckets_and_json_round_trip():
    m = Manifest.build(SHAPES, bucket_bytes=2048)
    # fp32: the 4096 B embedding alone (larger than a bucket), then 1024 + 64 B pairs, then the head
    assert m.buckets == ((0,), (1, 2), (3, 4), (5,))
    assert m.wire_dtype == "float32" and m.total_bytes == 4 * m.numel
    assert m.bucket_starts == (0, 1024, 1296, 1568, 2592)
    back = Manifest.from_json(json.loads(json.dumps(m.to_json())))
    assert back == m and back.bucket_starts == m.bucket_starts

    half = Manifest.build(SHAPES, bucket_bytes=2048, wire_dtype=torch.bfloat16)
    assert half.wire_dtype == "bfloat16" and half.dtype == torch.bfloat16
    assert half.buckets == ((0,), (1, 2, 3, 4), (5,))  # two bytes a value: more fits per bucket
    assert half.total_bytes == 2 * half.numel
    assert Manifest.from_json(json.loads(json.dumps(half.to_json()))) == half


def test_manifest_rejects_bad_input():
    m = Manifest.build(SHAPES, bucket_bytes=1 << 20)
    legacy = {k: v for k, v in m.to_json().items() if k not in ("wire_dtype", "piece_bytes")}
    assert Manifest.from_json(legacy).wire_dtype == "float32"  # manifests from before bf16
    assert Manifest.from_json(legacy).piece_bytes == m.piece_bytes
    assert Manifest.build(SHAPES, bucket_bytes=2048, piece_bytes=600).piece_numel == 150
    # no bucket in more than MAX_PIECES (8) broadcasts: the 1024-element embedding in 128s
    assert Manifest.build(SHAPES, bucket_bytes=2048, piece_bytes=4).piece_numel == 128
    with pytest.raises(ValueError, match="piece_bytes"):
        Manifest.build(SHAPES, bucket_bytes=1024, piece_bytes=0)
    assert wire_dtype_name("bf16") == "bfloat16" and wire_dtype_name(torch.float32) == "float32"
    with pytest.raises(ValueError, match="wire dtype"):
        Manifest.build(SHAPES, bucket_bytes=1024, wire_dtype="int8")
    with pytest.raises(ValueError, match="cover every parameter"):
        Manifest(m.names, m.shapes, ((0, 1),))


class _Model(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        for name, shape in shapes:
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(torch.zeros(shape)))


def _named_shapes(shapes):
    return [(n.replace(".", "_"), s) for n, s in shapes]


def _weights(version: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return [torch.randn(s, generator=g) for _, s in shapes]


def _barrier(pg) -> None:
    pg.allreduce([torch.zeros(1)]).wait()


def _sender(model, manifest, sync, ctl, shapes, *, direct):
    """One learner rank (`sync` is None on every rank but 0); returns the bytes each send broadcast."""
    import deepspeed

    from hpc_tba.comm.weight_sync import WeightSender

    sender = WeightSender(model, manifest, sync, direct_gather=direct)
    assert sender.direct == direct
    posted = _record_pieces(sender) if sync is not None else None

    def set_weights(v):
        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            for p, w in zip(params, _weights(v, shapes)):
                p.data.copy_(w)

    sent = []
    for v in (1, 2, 3):  # one at a time: the receivers check each version
        set_weights(v)
        sent.append(sender.send(v, flags=FLAG_EVAL if v == 2 else 0))
        if posted is not None:  # each piece held its final bytes when it was posted (gloo reads
            # it later, on its own thread: a piece posted early may still arrive intact)
            want = torch.cat([w.flatten() for w in _weights(v, shapes)]).to(manifest.dtype)
            assert torch.equal(torch.cat(posted), want), f"a piece of version {v} went too early"
            posted.clear()
        _barrier(ctl)
    for v in (4, 5, 6):  # back to back: take() must return only the newest
        set_weights(v)
        sender.send(v, flags=FLAG_EVAL if v == 5 else 0)
    _barrier(ctl)
    sender.stop()
    return sent


def _record_pieces(sender) -> list[torch.Tensor]:
    """A copy of every piece rank 0 broadcasts, taken when it is posted."""
    from hpc_tba.comm.weight_sync import sender as sender_mod

    posted, post = [], sender_mod.broadcast_async

    def recorded(pg, part):
        posted.append(part.clone())
        return post(pg, part)

    sender_mod.broadcast_async = recorded  # this spawned process's module: gone with it
    return posted


def _check(staged, version, dtype, shapes):
    assert staged is not None and staged.version == version
    want = _weights(version, shapes)
    assert [n for n, _ in staged.tensors] == [n for n, _ in _named_shapes(shapes)]
    for (name, got), w in zip(staged.tensors, want):
        assert got.dtype == dtype and got.shape == w.shape, name
        assert torch.equal(got, w.to(dtype)), f"{name} differs in version {version}"


def _receiver(manifest, sync, ctl, shapes):
    from hpc_tba.comm.weight_sync import WeightReceiver

    rx = WeightReceiver(manifest, sync)
    for v in (1, 2, 3):
        assert rx.wait_for(v, timeout=30), f"version {v} never arrived"
        staged, evals = rx.take()
        _check(staged, v, manifest.dtype, shapes)
        assert evals == ([2] if v == 2 else [])
        _barrier(ctl)
    _barrier(ctl)
    assert rx.wait_for(6, timeout=30)
    staged, evals = rx.take()
    _check(staged, 6, manifest.dtype, shapes)
    assert evals == [5] and rx.received_versions == [1, 2, 3, 4, 5, 6]
    assert rx.take() == (None, [])
    rx.join(timeout=30)
    assert not rx._thread.is_alive() and rx.stopped and rx.error is None


def _learner_model(rank: int, learners: int, port: int, shapes):
    """A ZeRO-3 module partitioned over `learners` gloo ranks (the learners' default group)."""
    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(learners))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=learners)
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = _Model(shapes)
    params = list(model.parameters())
    assert all(hasattr(p, "ds_id") for p in params)
    padded = [p for p in params if p.ds_tensor.numel() * learners > p.ds_numel]
    assert len(padded) == (4 if shapes is ODD_SHAPES else 0)  # ODD_SHAPES over two learners
    return model


def _worker(rank: int, learners: int, cases: list, ports: list[int], result_dir: str) -> None:
    """Processes 0..learners-1 are the learners (rank 0 alone is on the sync group), the last two
    the receivers."""
    os.environ.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    from hpc_tba.comm.weight_sync import new_group

    torch.set_num_threads(1)
    shapes = SHAPES if learners == 1 else ODD_SHAPES
    model = _learner_model(rank, learners, ports[0], shapes) if rank < learners else None
    sync = None
    if rank == 0 or rank >= learners:
        sync = new_group(host="127.0.0.1", port=ports[1], rank=max(0, rank - learners + 1), size=3,
                         backend="gloo", timeout_s=60)
    ctl = new_group(host="127.0.0.1", port=ports[2], rank=rank, size=learners + 2, backend="gloo",
                    timeout_s=60)
    for dtype, direct, piece in cases:
        manifest = Manifest.build(_named_shapes(shapes), bucket_bytes=2048, wire_dtype=dtype,
                                  piece_bytes=piece)
        if rank < learners:
            sent = _sender(model, manifest, sync, ctl, shapes, direct=direct)
            assert sent == [manifest.total_bytes if rank == 0 else 0] * 3
        else:
            _receiver(manifest, sync, ctl, shapes)
        _barrier(ctl)
    open(os.path.join(result_dir, f"ok{rank}"), "w").close()


def test_a_bucket_lying_back_to_back_is_broadcast_from_where_it_lies():
    """`WeightSender._in_place`: plain parameters that are consecutive views of one buffer, in the
    wire dtype, are their buckets already (no pack); a gap, another buffer or another dtype is not."""
    from hpc_tba.comm.weight_sync import WeightSender

    shapes = [("a", (4, 3)), ("b", (5,)), ("c", (2, 2)), ("d", (7,))]
    m = Manifest.build(shapes, bucket_bytes=4 * 17)  # buckets (a, b), (c, d)
    assert m.buckets == ((0, 1), (2, 3))

    def model(parts):
        mod = torch.nn.Module()
        for (n, s), t in zip(shapes, parts):
            mod.register_parameter(n, torch.nn.Parameter(t.view(s)))
        return mod

    flat = torch.randn(28)
    sender = WeightSender(model(flat.split([12, 5, 4, 7])), m, None)
    views = [sender._in_place(idx) for idx in m.buckets]
    assert [v.data_ptr() for v in views] == [flat.data_ptr(), flat[17:].data_ptr()]
    assert torch.equal(torch.cat(views), flat)
    gap = torch.randn(29)  # c starts one element after b ends: bucket (c, d) still lies whole
    sender = WeightSender(model([gap[:12], gap[12:17], gap[18:22], gap[22:]]), m, None)
    assert sender._in_place(m.buckets[0]) is not None and sender._in_place(m.buckets[1]) is not None
    sender = WeightSender(model([gap[:12], gap[13:18], gap[18:22], gap[22:29]]), m, None)
    assert sender._in_place(m.buckets[0]) is None  # a gap inside the bucket
    apart = [torch.randn(12), torch.randn(5), torch.randn(4), torch.randn(7)]
    assert WeightSender(model(apart), m, None)._in_place(m.buckets[0]) is None
    m16 = Manifest.build(shapes, bucket_bytes=4 * 17, wire_dtype="bf16")
    assert WeightSender(model(flat.split([12, 5, 4, 7])), m16, None)._in_place(m16.buckets[0]) is None


def _one_learner_with_optimizer(rank: int, port: int) -> list:
    """One ZeRO-3 learner after `deepspeed.initialize` with an optimizer (what a run's learner is):
    for each bucket, whether `_in_place` finds it lying whole, and whether what it finds is the
    bucket's bytes (GatheredParameters' view of the parameters, in manifest order)."""
    import deepspeed

    from hpc_tba.comm.weight_sync import WeightSender

    os.environ.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    model = _learner_model(rank, 1, port, SHAPES)
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    m = Manifest.build(_named_shapes(SHAPES), bucket_bytes=2048)
    sender = WeightSender(engine.module, m, None)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        want = torch.cat([p.data.flatten() for p in params]).clone()
    out = []
    for b, idx in enumerate(m.buckets):
        got = sender._in_place(idx)
        a, z = m.bucket_starts[b], m.bucket_starts[b + 1]
        out.append((got is not None, got is not None and torch.equal(got, want[a:z])))
    return out


def test_a_zero3_learner_of_one_sends_its_buckets_from_where_they_lie():
    """The path `_in_place` opens is a run's, not only the bench's: one ZeRO-3 learner's optimizer
    lays its shards back to back in module order (its flat fp32 partition), so every bucket is
    broadcast from there, and it holds exactly the bucket's bytes."""
    [found] = spawn_ranks(_one_learner_with_optimizer, 1, (free_ports(1)[0],), timeout_s=120)
    assert len(found) > 1 and all(lies and equal for lies, equal in found), found


def test_three_process_gloo_sync(tmp_path):
    # direct: all-gather from the ZeRO-3 shards into the staging slot; else GatheredParameters.
    # piece: bytes of one broadcast (a bucket travels as pieces cut across parameters: 600 B)
    cases = [(torch.float32, True, 1 << 20), (torch.bfloat16, True, 1 << 20),
             (torch.float32, False, 1 << 20), (torch.bfloat16, False, 1 << 20),
             (torch.float32, True, 600), (torch.bfloat16, False, 600)]
    spawn_ranks(_worker, 3, (1, cases, free_ports(3), str(tmp_path)), timeout_s=90)
    assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1", "ok2"]


def test_two_zero3_learners_send_pieces_that_end_before_the_padding(tmp_path):
    """Two learners: the direct gather's all-gather writes each odd-sized parameter's zero padding
    past its end (into the next parameter's place, overwritten by that one's gather); rank 0 must
    post only the 600 B pieces that lie below the gathered end. Both gather paths, fp32 (the
    all-gather lands in the slot: the padding spills) and bf16 (gathered into scratch, cast)."""
    cases = [(dtype, direct, 600) for direct in (True, False)
             for dtype in (torch.float32, torch.bfloat16)]
    spawn_ranks(_worker, 4, (2, cases, free_ports(3), str(tmp_path)), timeout_s=120)
    assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1", "ok2", "ok3"]


def test_a_member_that_reads_headers_late_still_reads_every_one():
    """Rank 0 may post sync headers faster than a member reads them (on gloo a broadcast completes
    on rank 0 once its sends are buffered): a header's key stays until every member has read it.
    Seen in a run: a searcher waited forever for a header whose key rank 0 had already dropped."""
    import threading

    from conftest import sync_group_pair

    from hpc_tba.comm.weight_sync.group import _HEADER_KEY, _STORES, post_header, wait_header

    tx, rx = sync_group_pair()
    for version in (2, 4, 6):  # three syncs announced before the member reads the first
        post_header(tx, [version, 0, 1])
    got = []
    reader = threading.Thread(target=lambda: got.extend(wait_header(rx, poll_s=1)[0] for _ in range(3)),
                              daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert got == [2, 4, 6], f"read {got} of [2, 4, 6] (a dropped header blocks the reader)"
    post_header(tx, [8, 0, 1])  # every earlier header was read: their keys go
    store = _STORES[id(tx)][0]
    assert [store.check([_HEADER_KEY.format(s)]) for s in range(4)] == [False, False, False, True]
