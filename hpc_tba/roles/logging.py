"""Run logging for one role: TensorBoard scalars/histograms, a metrics.jsonl, a progress bar,
and the role's time accounting (`Timers`: where its wall-clock time went).

Each role writes its own TensorBoard directory under `<run_dir>/tb/<name>` (learner, searcher0,
...), so TensorBoard pointed at `<run_dir>/tb` shows them as separate runs; `metrics.jsonl`
holds the same scalars for tools and tests.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import numpy as np


class RunLogger:
    def __init__(self, run_dir: str, name: str, *, enabled: bool = True, total: int | None = None):
        self.enabled = enabled
        self.run_dir = run_dir
        self._writer = self._jsonl = self._bar = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(os.path.join(run_dir, "tb", name), exist_ok=True)
        self._writer = SummaryWriter(os.path.join(run_dir, "tb", name), flush_secs=10)
        self._jsonl = open(os.path.join(run_dir, f"metrics_{name}.jsonl"), "a")
        if total is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=name, file=sys.stderr, mininterval=1.0,
                             dynamic_ncols=True, disable=os.environ.get("HPC_TBA_NO_PROGRESS") == "1")

    def scalars(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        for k, v in clean.items():
            self._writer.add_scalar(k, v, step)
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()

    def histogram(self, step: int, tag: str, values: np.ndarray) -> None:
        if self.enabled and len(values):
            self._writer.add_histogram(tag, np.asarray(values, dtype=np.float64), step)

    def progress(self, step: int, postfix: dict[str, str]) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(postfix, refresh=True)

    def write_json(self, name: str, obj: dict) -> None:
        if self.enabled:
            with open(os.path.join(self.run_dir, name), "w") as f:
                json.dump(obj, f, indent=2)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
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
