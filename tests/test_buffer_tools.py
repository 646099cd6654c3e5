"""Buffer tools and configs: inspector (read-only, PNGs), benchmark smoke run, yaml presets."""
from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
from buffer_helpers import contents, random_batch

from hpc_tba.buffer import BufferShard
from hpc_tba.config import BufferConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _digest(root: str) -> dict[str, str]:
    return {p: hashlib.sha256(open(p, "rb").read()).hexdigest()
            for p in sorted(glob.glob(os.path.join(root, "**", "*"), recursive=True))
            if os.path.isfile(p)}


def test_inspector_reads_without_writing_and_draws_histograms(tmp_path, capsys):
    import inspect_buffer

    root = str(tmp_path / "buffer")
    cfg = BufferConfig(warm_start=0, capacity=80, per_prompt_capacity=5, fsync="never")
    shards = [BufferShard(cfg, shard_id=i, num_shards=2, directory=root) for i in range(2)]
    rng = np.random.default_rng(0)
    for i in range(120):
        pid = int(rng.integers(0, 20))
        shards[pid % 2].add(random_batch(rng, pid, 3, version=i // 10))
    seg = glob.glob(os.path.join(root, "*", "shard-0001", "seg-*.tbs"))[0]
    with open(seg, "ab") as f:  # a writer in the middle of a record
        f.write(b"TBAR\x01\x00")
    before = _digest(root)
    inspect_buffer.main([root, "--png", str(tmp_path / "png"), "--prompt", "3"])
    out = capsys.readouterr().out
    assert _digest(root) == before  # not even the torn tail was truncated
    assert "torn bytes dropped on read 6" in out and "prompt 3 (shard 1)" in out
    snap, _ = BufferShard.snapshot(root, BufferConfig())
    assert contents(snap) == contents(shards) and snap[0].cfg.capacity == 80
    for name in ("reward", "staleness", "length", "per_prompt"):
        assert os.path.getsize(tmp_path / "png" / f"buffer_{name}.png") > 1000


def test_bench_prints_its_figures():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_buffer.py"),
                          "--batches", "300", "--samples", "50", "--capacity", "3000", "--durable"],
                         capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    assert out.count("inserts/s") == 2 and "resident/raw" in out and "stored 3,000" in out


@pytest.mark.parametrize("name", ["tba", "tldr", "redteam", "alol", "uniform"])
def test_buffer_yaml_composes_to_the_dataclass(name):
    pytest.importorskip("hydra")
    from hpc_tba.assembly.compose import compose

    cfg = compose([f"buffer={name}"]).buffer
    assert isinstance(cfg, BufferConfig)
    with open(os.path.join(ROOT, "configs", "buffer", f"{name}.yaml")) as f:
        text = f.read()
    assert text.split("\n", 1)[1].startswith("defaults:\n  - buffer_schema")


@pytest.mark.parametrize("bad, words", [({"eviction": "newest"}, "eviction"),
                                        ({"fsync": "sometimes"}, "fsync"),
                                        ({"compact_ratio": 1.0}, "compact_ratio"),
                                        ({"segment_bytes": 10}, "too small")])
def test_config_validation_names_the_field(bad, words):
    with pytest.raises(ValueError, match=words):
        BufferConfig(**bad)


def test_buffer_imports_without_engines():
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            "import hpc_tba.buffer, buffer_helpers; "
            "print(sorted(m for m in ('deepspeed', 'vllm', 'mpi4py', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
