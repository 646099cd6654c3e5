"""Run-directory files that readers poll while a run writes them (status, summary, histograms,
failure records): written atomically, read tolerantly. No torch, so `hpc-tba status` stays fast."""
from __future__ import annotations

import json
import os


def write_json_atomic(path: str, obj: dict) -> None:
    """Readers (status polling mid-run) see the old file or the new one, never half of one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def read_json(path: str) -> dict | None:
    """A run file written by `write_json_atomic` (status, summary, histograms), None when it is
    absent or unreadable (a run that has not written it yet)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a metrics_<role>.jsonl, oldest first; [] when absent. A line cut off by a crash
    or still being written is skipped."""
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


COMPLETE = "COMPLETE"
"""Marker file written last into a checkpoint directory: without it the checkpoint is incomplete."""


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest complete checkpoint directory, or None (half-written ones are ignored). Here,
    not in hpc_tba.checkpoint.store, so that `hpc-tba status` finds it without importing torch."""
    root = checkpoint_root(run_dir)
    pointer = os.path.join(root, "latest")
    candidates = []
    if os.path.isfile(pointer):
        with open(pointer) as f:
            candidates.append(os.path.join(root, f.read().strip()))
    if os.path.isdir(root):  # `latest` lost or pointing at a removed dir: fall back to a scan
        candidates += sorted((os.path.join(root, d) for d in os.listdir(root) if d.startswith("step_")),
                             reverse=True)
    return next((p for p in candidates if os.path.isfile(os.path.join(p, COMPLETE))), None)
