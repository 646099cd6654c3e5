"""The benchmarks that had no run in the suite, at tiny sizes: each prints its figure lines (no
thresholds: timings on a shared machine are not assertions), so no change breaks one unseen
(bench_learner once crashed on main after its first line, issue 26). bench_buffer and
bench_transport run in their own tests; bench_async (two whole runs, 2.5 min even at 4 steps)
only under `-m long`."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str, timeout: float = 900) -> str:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", script), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{script} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _figure(out: str, name: str) -> float:
    lines = [line for line in out.splitlines() if line.startswith(f"{name} = ")]
    assert lines, f"no `{name} = ...` line in:\n{out[-3000:]}"
    return float(lines[-1].split(" = ", 1)[1].split()[0])


def test_bench_learner_prints_its_figures():
    out = _run("bench_learner.py", "--sizes", "1m", "--algo", "tb", "--no-memory", "--steps", "0",
               "--threads", "1")
    for name in ("learner/plain-deepspeed tokens/s", "peak measured/planned"):
        assert _figure(out, name) > 0
    # each side's CPU use in its timed step, so that a disturbed pair shows (issue 26)
    assert out.count("faults/s") == 2 and "CPU " in out, out[-3000:]


def test_bench_sp_prints_its_figures():
    out = _run("bench_sp.py", "--size", "1m", "--k", "2", "--steps", "0")
    for name in ("peak SP2/SP1 at 4x length", "tokens/s SP2/SP1"):
        assert _figure(out, name) > 0


def test_bench_packing_prints_its_figures():
    out = _run("bench_packing.py", "--size", "1m", "--groups", "1", "--k", "2", "--micro", "2",
               "--max-response", "32", "--spread", "4", "--steps", "1")
    assert _figure(out, "packed/padded tokens/s") > 0
    assert _figure(out, "packed/padded loss max abs diff") >= 0


def test_bench_weight_sync_prints_its_figures():
    out = _run("bench_weight_sync.py", "--params", "2e6", "--bucket-mb", "1", "--repeats", "1",
               "--engine-bucket-mb", "1", "--engine-buckets", "32")
    rows = [line for line in out.splitlines() if line.startswith("|") and line.rstrip().endswith("|")]
    assert rows and rows[-1].rstrip().endswith("yes |"), out[-3000:]  # the receivers' copy is bit-exact
    for name in ("engine-process sync peak/bucket", "engine-process sync / raw broadcast"):
        assert _figure(out, name) > 0


def test_bench_inflight_prints_its_figures():
    """Every mode runs (continuous, between rounds, bare vLLM) and the three figures print; the
    headline is the median of the interleaved pairs' ratios, each printed."""
    import numpy as np

    out = _run("bench_inflight.py", "--seconds", "3", "--max-new-tokens", "16", "--per-step", "4",
               "--train-s", "0.1", "--pairs", "3", "--pair-seconds", "0.5")
    for name in ("sync staging peak/bucket", "in_flight/between_rounds learner wait",
                 "in_flight/bare-vllm tokens/s"):
        assert _figure(out, name) > 0
    assert "| continuous" in out and "| bare-vllm" in out
    pairs = [line for line in out.splitlines() if line.startswith("pair ")]
    ratios = [float(line.rsplit(" = ", 1)[1]) for line in pairs]
    assert len(pairs) == 3 and all(" updates, " in line for line in pairs), out[-3000:]
    assert abs(_figure(out, "in_flight/bare-vllm tokens/s") - float(np.median(ratios))) < 1.5e-3
    # the figure's three windows side by side, each with its vLLM step (bench_probe)
    windows = [line for line in out.splitlines() if line.startswith("(windows: ")]
    assert windows and windows[0].count("median vLLM step") == 3, out[-3000:]
    assert "tokens per median step-time" in out


def test_bench_probe_window_counts_its_steps_and_threads():
    """A Window summarises only the steps that started inside it, and a busy thread's CPU."""
    import threading
    import time

    from bench_probe import Window

    steps = [(time.perf_counter() - 10.0, 1.0)]  # before the window: not counted
    stop = threading.Event()
    busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    busy.start()
    w = Window(steps)
    w.threads = {"busy": busy.native_id}
    w.start()
    for ms in (2.0, 4.0, 30.0):
        steps.append((time.perf_counter(), ms / 1e3))
    time.sleep(0.3)
    out = w.stop()
    stop.set()
    busy.join()
    assert out["steps"] == 3 and abs(out["step_ms"] - 4.0) < 1e-9
    assert out["threads"]["busy"] > 0 and out["cpu_per_wall"] > 0 and out["others_cores"] >= 0


def test_bench_probe_pair_ratios_cancel_a_linear_drift():
    """A mode window at 0.9 of bare on a machine whose speed drifts linearly reads 0.9 in every
    pair (bare windows on both sides); the counts of windows must match."""
    from bench_probe import pair_ratios

    speed = [1.0 + 0.1 * t for t in range(9)]  # windows in order: bare, mode, bare, ..., bare
    bares, modes = [1000 * v for v in speed[0::2]], [900 * v for v in speed[1::2]]
    assert all(abs(r - 0.9) < 1e-12 for r in pair_ratios(modes, bares))
    with pytest.raises(ValueError):
        pair_ratios(modes, bares[:-1])


def test_bench_searcher_prints_its_ratio():
    out = _run("bench_searcher.py", "--rounds", "2", "--warmup", "1")
    lines = [line for line in out.splitlines() if line.startswith("ratio searcher / bare vLLM generate: ")]
    assert lines and float(lines[-1].split(": ", 1)[1].split()[0]) > 0, out[-3000:]


@pytest.mark.long
def test_bench_async_prints_its_ratios(tmp_path):
    out = _run("bench_async.py", "--seeds", "0", "--steps", "4", "--eval-every", "2", "--runs",
               str(tmp_path / "runs"), "--out", str(tmp_path), "buffer.warm_start=50")
    assert "sync ÷ async seconds per step:" in out and (tmp_path / "bench_async.json").exists(), out[-3000:]
