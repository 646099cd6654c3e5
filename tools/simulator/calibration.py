"""Predict the sync / async ratio of a measured run from its measured per-role costs."""
from __future__ import annotations

from simulator.config import SimConfig, with_fields
from simulator.schedules import simulate_async, simulate_sync

CALIBRATION_KEYS = {
    "gen_samples_per_s": "samples per second one searcher generates (required)",
    "learner_step_s": "seconds per learner step, excluding syncs (required)",
    "sync_s": "seconds the learner spends per weight sync (required)",
    "apply_s": "seconds a searcher stalls to load new weights (default 0)",
    "samples_per_prompt": "S (required)",
    "k": "K (required)",
    "prompts_per_step": "prompts per learner step per learner rank (required)",
    "prompts_per_round": "prompts per searcher round (default 1)",
    "num_searchers": "searchers (required)",
    "num_learners": "learner ranks (default 1)",
    "sync_every": "k, steps between syncs (required)",
    "steps": "learner steps of the measured run (required)",
    "warm_start_samples": "samples before the first async step (default 0)",
    "recency_m": "m (default 0.95)",
    "sync_mode / async_mode": "optional dicts of the same keys measured in that mode (override)",
    "measured_speedup": "optional: the measured sync / async time ratio, to state the error",
}


def calibrated_config(measured: dict, mode: str) -> SimConfig:
    """A SimConfig whose costs are the measured per-role costs (one 'token' = one sample)."""
    data = {**{k: v for k, v in measured.items() if not isinstance(v, dict)},
            **measured.get(f"{mode}_mode", {})}
    data.pop("measured_speedup", None)
    missing = [k for k in ("gen_samples_per_s", "learner_step_s", "sync_s", "samples_per_prompt", "k",
                           "prompts_per_step", "num_searchers", "sync_every", "steps") if k not in data]
    if missing:
        raise ValueError(f"calibration JSON lacks: {', '.join(missing)}")
    fields = {"tokens_per_sample": 1.0, "prompt_tokens": 0.0,
              "apply_s": 0.0, "warm_start_samples": 0, "gen_cv": 0.0, "learner_cv": 0.0, **data}
    return with_fields(SimConfig(), fields)


def calibrate(measured: dict) -> dict:
    """Predict the sync / async ratio from measured per-role costs; compare with the measured one."""
    s = simulate_sync(calibrated_config(measured, "sync"))
    a = simulate_async(calibrated_config(measured, "async"))
    out = {"sync_wall_s": s.wall_s, "async_wall_s": a.wall_s, "predicted_speedup": s.wall_s / a.wall_s,
           "sync": s.summary(int(measured["k"])), "async": a.summary(int(measured["k"]))}
    if "measured_speedup" in measured:
        m = float(measured["measured_speedup"])
        out["measured_speedup"] = m
        out["relative_error"] = (out["predicted_speedup"] - m) / m
    return out
