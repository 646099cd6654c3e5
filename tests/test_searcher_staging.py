"""Searcher and bounded staging without an engine: a rebuilt engine reloads the version the
receiver holds whole, or, when none is whole (stream staging, or a newer version half received),
waits for the next one instead of sampling with the checkpoint's weights. Config checks."""
from __future__ import annotations

import contextlib

import pytest
import torch

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
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import build_task
    from hpc_tba.topology import Topology

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
