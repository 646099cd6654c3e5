"""Collect one finished run's metrics and curves, and aggregate them over seeds.

`collect_run` reads a run directory's own files (summary.json, metrics_learner.jsonl,
eval/eval.json; see runner.py for the layout); `aggregate_arm` gives per metric and per curve the
mean, sample standard deviation (ddof 1; 0 for one seed), min and max over an arm's seeds, curves
at the steps every seed logged; `results_id` fingerprints the aggregated numbers.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

ALWAYS_CURVES = ("time/elapsed_s",)


# --------------------------------------------------------------------------- collection

def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line of an interrupted writer
                continue
    return rows


def collect_run(run_dir: Path, curve_keys: Sequence[str] = ()) -> tuple[dict[str, float], dict]:
    """(scalar metrics, curves {key: [[step, value], ...]}) of one finished run directory."""
    metrics: dict[str, float] = {}
    curves: dict[str, list[list[float]]] = {}
    learner = run_dir / "metrics_learner.jsonl"
    if learner.is_file():
        rows = _read_jsonl(learner)
        for key in dict.fromkeys((*ALWAYS_CURVES, *curve_keys)):
            by_step = {int(r["step"]): float(r[key]) for r in rows
                       if key in r and "step" in r and _finite(r[key])}
            if by_step:
                curves[key] = [[s, v] for s, v in sorted(by_step.items())]
    summary = run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        if "steps" in s:
            metrics["steps"] = float(s["steps"])
        for key in ("pass@1_before", "pass@1_after"):
            if _finite(s.get(key)):
                metrics[f"summary/{key}"] = float(s[key])
        versions = {int(v): float(x) for v, x in (s.get("pass@1") or {}).items() if _finite(x)}
        if versions:
            curves["test/pass@1"] = [[v, x] for v, x in sorted(versions.items())]
    for key, series in curves.items():
        values = [v for _, v in series]
        metrics[f"{key}@last"] = values[-1]
        metrics[f"{key}@mean"] = sum(values) / len(values)
    ev = run_dir / "eval" / "eval.json"
    if ev.is_file():
        metrics.update({k: float(v) for k, v in json.loads(ev.read_text())["metrics"].items()
                        if _finite(v)})
    return metrics, curves


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------- aggregation

def summarize(values: Sequence[float]) -> dict:
    """mean, sample std (ddof 1; 0 for one value), min, max, n and the values themselves."""
    if not values:
        raise ValueError("summarize of no values")
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n,
            "values": list(values)}


def aggregate_curve(series: Sequence[Sequence[Sequence[float]]]) -> dict:
    """Mean and std over seeds of curves [[step, value], ...], at the steps every seed logged."""
    maps = [{int(s): float(v) for s, v in one} for one in series]
    common = sorted(set.intersection(*(set(m) for m in maps))) if maps else []
    stats = [summarize([m[s] for m in maps]) for s in common]
    return {"step": common, "mean": [x["mean"] for x in stats], "std": [x["std"] for x in stats],
            "n": len(maps)}


def aggregate_arm(records: Sequence[dict]) -> dict:
    """Per metric and per curve of one arm's runs: the summary over seeds."""
    keys = dict.fromkeys(k for r in records for k in r["metrics"])
    metrics = {k: summarize([r["metrics"][k] for r in records if k in r["metrics"]]) for k in keys}
    ckeys = dict.fromkeys(k for r in records for k in r["curves"])
    curves = {k: aggregate_curve([r["curves"][k] for r in records if k in r["curves"]])
              for k in ckeys}
    return {"metrics": metrics, "curves": curves}


def results_id(arms: Sequence[dict]) -> str:
    """A short fingerprint of the aggregated numbers: a hand-written discussion records the id it
    was written against, and the report flags it when the numbers have changed since."""
    blob = json.dumps([[a["name"], {k: round(v["mean"], 4) for k, v in sorted(a["metrics"].items())
                                    if not k.startswith("wall/") and not k.startswith("time/")}]
                       for a in arms], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]
