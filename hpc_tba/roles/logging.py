"""Run logging for one role: TensorBoard scalars/histograms, a metrics.jsonl, a progress bar,
and the role's time accounting (`Timers`: where its wall-clock time went).

Each role writes its own TensorBoard directory under `<run_dir>/tb/<name>` (learner, searcher0,
...), so TensorBoard pointed at `<run_dir>/tb` shows them as separate runs; `metrics_<name>.jsonl`
holds the same scalars for tools and tests, `histograms_<name>.json` the counts of integer-valued
histograms (the staleness lags) for hpc_tba.cli.report. The learner's logger also keeps
`<run_dir>/status.json` (replaced atomically, at most every STATUS_EVERY_S and at the end): the
latest step, policy version, buffer, staleness, checkpoint and held-out pass@1 that
`hpc-tba status` reads, plus the process and Slurm job that wrote it.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time

import numpy as np

from hpc_tba.checkpoint.runfiles import write_json_atomic

STATUS_EVERY_S = 1.0
"""Shortest interval between two writes of status.json."""
HISTOGRAMS_EVERY_S = 10.0
"""Shortest interval between two writes of histograms_<name>.json."""
# status.json field <- the scalar it follows (the latest value logged).
STATUS_SCALARS = {"policy_version": "sync/version", "buffer_size": "buffer/size",
                  "staleness_mean": "buffer/staleness_mean", "staleness_max": "buffer/staleness_max",
                  "reward_sampled_mean": "reward/sampled_mean", "elapsed_s": "time/elapsed_s"}


class RunLogger:
    def __init__(self, run_dir: str, name: str, *, enabled: bool = True, total: int | None = None):
        self.enabled = enabled
        self.run_dir = run_dir
        self.name = name
        self._writer = self._jsonl = self._bar = self._bar_args = None
        self._hist: dict[str, dict[int, int]] = {}
        self._written = {"status": 0.0, "hist": 0.0}
        self.status: dict | None = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        from hpc_tba.launcher.console import terminal

        os.makedirs(os.path.join(run_dir, "tb", name), exist_ok=True)
        self._writer = SummaryWriter(os.path.join(run_dir, "tb", name), flush_secs=10)
        self._jsonl = open(os.path.join(run_dir, f"metrics_{name}.jsonl"), "a")
        self._bar_args = None if total is None else dict(
            total=total, desc=name, file=terminal("err"), mininterval=1.0, dynamic_ncols=True,
            disable=os.environ.get("HPC_TBA_NO_PROGRESS") == "1")
        if name == "learner":
            self.status = {"state": "running", "pid": os.getpid(), "host": socket.gethostname(),
                           "started_at": time.time(), "total_steps": total, "step": 0,
                           "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                           "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0)}
            self._write_status(force=True)

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        for k, v in clean.items():
            self._writer.add_scalar(k, v, step)
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()
        if self.status is not None:
            self._follow(step, clean)

    def _follow(self, step: int, clean: dict[str, float]) -> None:
        """Update status.json from the scalars the learner logs anyway."""
        st = self.status
        if any(k.startswith("loss/") for k in clean):  # a training step's row
            st["step"] = max(st["step"], step)
        for field, key in STATUS_SCALARS.items():
            if key in clean:
                st[field] = clean[key]
        if "test/pass@1" in clean:
            st["pass@1"] = {"version": step, "value": clean["test/pass@1"]}
            st.setdefault("pass@1_first", st["pass@1"])
        if "checkpoint/time_s" in clean:
            st["last_checkpoint_step"] = step
        if "checkpoint/resumed_step" in clean:
            st["step"] = st["resumed_from_step"] = step
        self._write_status()

    def _write_status(self, *, force: bool = False) -> None:
        now = time.time()
        if force or now - self._written["status"] >= STATUS_EVERY_S:
            self.status["updated_at"] = now
            write_json_atomic(os.path.join(self.run_dir, "status.json"), self.status)
            self._written["status"] = now

    def histogram(self, step: int, tag: str, values: np.ndarray) -> None:
        if not (self.enabled and len(values)):
            return
        values = np.asarray(values, dtype=np.float64)
        self._writer.add_histogram(tag, values, step)
        if np.all(values == np.round(values)):  # integer values (lags): exact counts for plots
            counts = self._hist.setdefault(tag, {})
            for v, n in zip(*np.unique(values.astype(np.int64), return_counts=True)):
                counts[int(v)] = counts.get(int(v), 0) + int(n)
            self._write_histograms()

    def _write_histograms(self, *, force: bool = False) -> None:
        now = time.time()
        if self._hist and (force or now - self._written["hist"] >= HISTOGRAMS_EVERY_S):
            write_json_atomic(os.path.join(self.run_dir, f"histograms_{self.name}.json"),
                              {tag: {str(k): n for k, n in sorted(c.items())} for tag, c in self._hist.items()})
            self._written["hist"] = now

    def progress(self, step: int, postfix: dict[str, str]) -> None:
        if self._bar is None and self._bar_args is not None:  # from the first step, so that it
            from tqdm import tqdm  # does not mix with the start-up lines

            self._bar, self._bar_args = tqdm(initial=step, **self._bar_args), None
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(postfix, refresh=True)

    def write_json(self, name: str, obj: dict) -> None:
        if self.enabled:  # atomic: `hpc-tba status` and `report` may read it while it is written
            write_json_atomic(os.path.join(self.run_dir, name), obj)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.enabled:
            self._write_histograms(force=True)
        if self.status is not None:
            summary = os.path.join(self.run_dir, "summary.json")  # written by this run, not a resumed one's
            finished = os.path.isfile(summary) and os.path.getmtime(summary) >= self.status["started_at"]
            self.status["state"] = "finished" if finished else "stopped"
            self._write_status(force=True)
            self.status = None
        if self._writer is not None:
            self._writer.close()
            self._jsonl.close()


class Timers:
    """Wall-clock seconds a role spent on each activity since it started, for `util/` scalars.

    `with timers("train"): ...` adds the block's duration to "train". A block inside another
    counts towards the outer one only, so the activities never overlap and their fractions plus
    `util/other` (time in none of them) sum to 1.
    """

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._active = False

    @contextlib.contextmanager
    def __call__(self, activity: str):
        if self._active:
            yield
            return
        self._active, t = True, time.perf_counter()
        try:
            yield
        finally:
            self.seconds[activity] = self.seconds.get(activity, 0.0) + time.perf_counter() - t
            self._active = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def metrics(self) -> dict[str, float]:
        """`time/<activity>_s` (cumulative), `util/<activity>` (fraction of the elapsed time),
        `util/other`, and `time/elapsed_s`."""
        elapsed = max(self.elapsed(), 1e-9)
        out = {"time/elapsed_s": elapsed}
        for k, v in sorted(self.seconds.items()):
            out[f"time/{k}_s"] = v
            out[f"util/{k}"] = v / elapsed
        out["util/other"] = max(0.0, 1.0 - sum(self.seconds.values()) / elapsed)
        return out


def peak_memory_gib(device) -> float:
    """This process's peak memory on the role's device, GiB: on a GPU, the most torch's caching
    allocator held (max_memory_reserved, what the GPU had to give; the smoke job's figure beside
    the plan's); on CPU the process's peak resident set (ru_maxrss), the only peak there is. Two
    branches by device, unavoidably: tools/gpu_check.sh reads the GPU one back after a ZeRO-3 step."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.max_memory_reserved(dev) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def device_used_gib(device) -> float:
    """GiB in use on the role's GPU as the driver counts it (cudaMemGetInfo: torch's pool, NCCL's
    buffers, the CUDA context and anything else on the device), sampled now; NaN on CPU (no
    such figure; reduce_metrics drops a key NaN on every rank)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return math.nan
    free, total = torch.cuda.mem_get_info(dev)
    return (total - free) / 2**30
