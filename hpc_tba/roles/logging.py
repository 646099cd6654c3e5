"""Run logging for one role: TensorBoard scalars/histograms, a metrics.jsonl, a progress bar.

Each role writes its own TensorBoard directory under `<run_dir>/tb/<name>` (learner, searcher0,
...), so TensorBoard pointed at `<run_dir>/tb` shows them as separate runs; `metrics.jsonl`
holds the same scalars for tools and tests.
"""
from __future__ import annotations

import json
import math
import os
import sys

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
