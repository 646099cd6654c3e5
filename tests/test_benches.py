"""The benchmarks that had no run in the suite, at tiny sizes: each prints its figure lines (no
thresholds: timings on a shared machine are not assertions), so no change breaks one unseen
(bench_learner once crashed on main after its first line, issue 26)."""
from __future__ import annotations

import os
import subprocess
import sys

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
               "--sp-k", "2", "--threads", "1")
    for name in ("learner/plain-deepspeed tokens/s", "peak measured/planned", "peak SP2/SP1 at 4x length",
                 "tokens/s SP2/SP1"):
        assert _figure(out, name) > 0


def test_bench_weight_sync_prints_its_figures():
    out = _run("bench_weight_sync.py", "--params", "2e6", "--bucket-mb", "1", "--repeats", "1",
               "--engine-params", "1e6", "--engine-buckets", "32")
    rows = [line for line in out.splitlines() if line.startswith("|") and line.rstrip().endswith("|")]
    assert rows and rows[-1].rstrip().endswith("yes |"), out[-3000:]  # the receivers' copy is bit-exact
    for name in ("engine-process sync peak/bucket", "engine-process sync / raw broadcast"):
        assert _figure(out, name) > 0
