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
