"""Searcher and bounded staging without an engine: a rebuilt engine reloads the version the
receiver holds whole, or, when none is whole (stream staging, or a newer version half received),
waits for the next one instead of sampling with the checkpoint's weights. Config checks."""
from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import sync_group_pair

from hpc_tba.comm.weight_sync import StagedWeights, StreamedWeights


class _Engine:
    def __init__(self):
        self.version, self.loads, self.updates_in_flight = 0, [], 0

    def tokenize(self, texts):
        return [[1] * 3 for _ in texts]

    def load_weights(self, tensors, version):
        self.loads.append((version, [n for n, _ in tensors]))
        self.version = version

    def close(self):
        pass


class _Receiver:
    def __init__(self, whole: StagedWeights | None):
        self.whole, self.latest, self.received_versions, self.stopped = whole, None, [1], False
        self.staging, self.skipped_versions = "host", []

    @contextlib.contextmanager
    def reading(self):
        yield

    def current(self):
        return self.whole

    def ready(self):
        return self.latest is not None

    def take(self):
        latest, self.latest = self.latest, None
        return latest, []

    def wait_for(self, version, timeout=None):
        return self.latest is not None


def _searcher(tmp_path, receiver, engines):
    from hpc_tba.config import SearcherConfig, TaskConfig
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import build_task

    s = Searcher(cfg=SearcherConfig(), task=build_task(TaskConfig()), engine=engines.pop(0),
                 receiver=receiver, transport=None, topo=Topology.build(2, 1, 1), index=0,
                 run_dir=str(tmp_path), engine_factory=lambda: engines.pop(0))
    return s


def test_rebuilt_engine_reloads_the_whole_staged_version(tmp_path):
    whole = StagedWeights(4, 0, [("w", torch.zeros(2))])
    s = _searcher(tmp_path, _Receiver(whole), [_Engine(), _Engine()])
    s.engine.version = 3  # applied 3; version 4 arrived whole since
    s.restart_engine(RuntimeError("boom"))
    assert s.engine.version == 4 and s.engine.loads == [(4, ["w"])] and not s._await_weights
    s.close()


def test_rebuilt_engine_without_a_whole_version_waits_for_the_next(tmp_path):
    rx = _Receiver(None)
    s = _searcher(tmp_path, rx, [_Engine(), _Engine()])
    s.engine.version = 3
    s.restart_engine(RuntimeError("boom"))
    assert s.engine.version == 0 and s._await_weights  # on the checkpoint: must not sample
    tensors = iter([("w", torch.ones(2))])
    rx.latest = StreamedWeights(5, 0, lambda: tensors)
    s.apply_weights()
    assert s.engine.version == 5 and not s._await_weights
    s.close()


def test_config_takes_stream_staging_out_of_process_and_refuses_a_bad_span():
    from hpc_tba.config import SearcherConfig

    assert SearcherConfig(staging="stream", tensor_parallel_size=2).engine_process
    with pytest.raises(ValueError, match="max_version_span"):
        SearcherConfig(max_version_span=-1)
    assert SearcherConfig(update="in_flight", engine_process=True).update == "in_flight"


# ---------------------------------------------------------------- a busy or slow searcher


def _send(pg, m, version: int) -> float:
    """Learner side of one sync (header on the host, then every bucket); returns its seconds."""
    import time

    from hpc_tba.comm.weight_sync import broadcast_async, post_header

    t0 = time.perf_counter()
    post_header(pg, [version, 0, len(m.buckets)])
    flat = torch.full((m.numel,), float(version))
    works = [broadcast_async(pg, flat[a:b]) for a, b in zip(m.bucket_starts, m.bucket_starts[1:])]
    for w in works:
        w.wait()
    return time.perf_counter() - t0


class _SlowEngine(_Engine):
    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    def load_weights(self, tensors, version):
        import time

        got = [(n, t.clone()) for n, t in tensors]
        time.sleep(self.delay_s)  # a searcher slowed on purpose while loading
        assert all(torch.all(t == version) for _, t in got)
        self.loads.append((version, [n for n, _ in got]))
        self.version = version


@pytest.mark.parametrize("staging", ["stream", "host"])
def test_a_busy_or_slow_searcher_never_holds_the_learner_and_takes_the_newest(tmp_path, staging):
    import threading
    import time

    from hpc_tba.comm.weight_sync import Manifest, WeightReceiver, stop_receivers

    m = Manifest.build([(f"w{i}", (256,)) for i in range(32)], bucket_bytes=1024)  # 32 buckets
    tx, rx_pg = sync_group_pair()
    rx = WeightReceiver(m, rx_pg, staging=staging)
    s = _searcher(tmp_path, rx, [_SlowEngine(0.5)])
    if staging == "stream":
        with s._busy():  # a round under way: versions arriving now are skipped, not held
            alone = [_send(tx, m, 1)]
            slow = [_send(tx, m, v) for v in (2, 3)]
            deadline = time.time() + 10  # the receiver counts a version once its last bucket is in
            while len(rx.skipped_versions) < 3 and time.time() < deadline:
                time.sleep(0.01)
        assert rx.skipped_versions == [1, 2, 3] and not rx.ready()
        threading.Timer(0.2, lambda: _send(tx, m, 4)).start()
        s.apply_weights()  # versions went by: waits (at most a round) for the next, takes it
    else:
        alone = [_send(tx, m, 1)]  # nobody loads it yet: the baseline
        assert rx.wait_for(1, 30)
        loader = threading.Thread(target=s.apply_weights)  # loads v1 for 0.5 s
        loader.start()
        while not s.engine.loads and not rx._readers:
            pass
        slow = [_send(tx, m, v) for v in (2, 3)]  # while the 0.5 s load reads the buffer
        loader.join()
        assert 2 in rx.skipped_versions  # arrived during the load: drained, never waited for
        _send(tx, m, 4)
        assert rx.wait_for(4, 30)
        s.apply_weights()
    assert s.engine.version == 4 and s.engine.loads[-1][0] == 4
    print(f"\n{staging}: learner sync alone {alone[0] * 1e3:.0f} ms, with a busy/slow searcher "
          f"{', '.join(f'{t * 1e3:.0f}' for t in slow)} ms; skipped {rx.skipped_versions}")
    assert max(slow) < 0.25  # a 0.5 s load (or a round) never shows in the learner's sync
    stop_receivers(tx)
    rx.join(timeout=30)
    assert rx.error is None
    s.close()
