"""The scheduling simulator: hand-checkable wall times, bounds on staleness, utilisation that adds
up, determinism, calibration from measured costs, and the CLI writing its PNGs."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from simulator.calibration import calibrate
from simulator.config import STATES, SimConfig
from simulator.presets import PRESETS, preset
from simulator.schedules import compare, simulate, simulate_async, simulate_sync

from tests.conftest import REPO

# One prompt = S samples of one token at 6 tokens/s: 4/6 s per prompt on one engine.
BASE = SimConfig(gen_tokens_per_s=6.0, tokens_per_sample=1, samples_per_prompt=4, k=2,
                     prompts_per_step=3, prompts_per_round=1, learner_step_s=2.0, sync_s=0.5,
                     apply_s=0.0, sync_every=2, num_searchers=2, num_learners=1, steps=20,
                     warm_start_samples=0, recency_m=1.0)


def test_sync_time_is_steps_times_gen_plus_train_plus_sync():
    r = simulate_sync(BASE)
    gen = 3 * (4 / 6) / 2  # 3 prompts x 4/6 s split over 2 engines = 1 s
    assert r.wall_s == pytest.approx(20 * (gen + 2.0 + 0.5), rel=1e-12)
    assert r.utilisation["learner"] == pytest.approx(
        {"generating": 0.0, "training": 2 / 3.5, "syncing": 0.5 / 3.5, "waiting": 1 / 3.5})
    assert r.utilisation["searcher"]["generating"] == pytest.approx(1 / 3.5)
    assert r.samples_generated == 20 * 3 * 4 and r.samples_trained == 20 * 3 * 2
    assert not r.staleness.any()  # on-policy: every sample comes from the current weights


def test_async_with_fast_generation_is_learner_bound():
    cfg = BASE.replace(gen_tokens_per_s=400.0)  # a round of 1 prompt takes 0.01 s
    r = simulate_async(cfg)
    # the first round arrives at 0.01 s; then 20 steps back to back and 10 syncs
    assert r.wall_s == pytest.approx(0.01 + 20 * 2.0 + 10 * 0.5, rel=1e-9)
    assert r.utilisation["learner"]["waiting"] == pytest.approx(0.01 / r.wall_s)
    # an odd N still ends with a sync (after steps 2 and 3), as the real learner does
    assert simulate_async(cfg.replace(steps=3)).wall_s == pytest.approx(0.01 + 3 * 2.0 + 2 * 0.5)
    assert compare(cfg)["speedup"] > 1.0


def test_async_with_fast_learning_is_generation_bound():
    # each step consumes 3 new prompts (replay ratio 1); 3 searchers each make 1 prompt per second
    cfg = BASE.replace(gen_tokens_per_s=4.0, num_searchers=3, learner_step_s=0.0, sync_s=0.0,
                       replay_ratio=1.0)
    r = simulate_async(cfg)
    assert r.wall_s == pytest.approx(20.0)
    assert r.utilisation["searcher"]["generating"] == pytest.approx(1.0)
    assert r.utilisation["learner"]["waiting"] == pytest.approx(1.0)


def test_learner_waits_for_warm_start():
    cfg = BASE.replace(gen_tokens_per_s=400.0, warm_start_samples=40)  # 10 prompts = 5 rounds each
    assert simulate_async(cfg).wall_s == pytest.approx(0.05 + 45.0, rel=1e-9)


@pytest.mark.parametrize("round_over_step", [0.5, 2.0, 5.0])
def test_async_staleness_is_bounded_by_the_round_to_step_ratio(round_over_step):
    # round = ratio x step; samples that fill recency slots (m = 1) were generated at most a few
    # syncs before, and the number of syncs a round spans is set by the round / sync-period ratio
    cfg = BASE.replace(gen_tokens_per_s=4.0 / (2.0 * round_over_step), steps=60,
                       num_searchers=math.ceil(4 * round_over_step))
    r = simulate_async(cfg)
    period = cfg.sync_every * cfg.step_cost_s + cfg.sync_cost_s  # seconds between two syncs
    bound = cfg.sync_every * (math.ceil((cfg.prompt_gen_s + cfg.apply_cost_s) / period) + 2)
    fresh = r.staleness[r.recent]
    assert r.recent.mean() > 0.3 and fresh.min() >= 0 and fresh.max() <= bound
    assert fresh.max() >= round_over_step - 1  # slower generation makes staler samples
    assert r.staleness_stats()["max_recent"] == fresh.max()


def test_starved_recency_falls_back_to_uniform_and_staleness_grows():
    ample = simulate_async(BASE.replace(num_searchers=8, steps=60)).staleness
    starved = simulate_async(BASE.replace(gen_tokens_per_s=0.4, num_searchers=2, steps=60)).staleness
    assert starved.max() > 3 * ample.max()


def test_recency_lowers_staleness():
    cfg = BASE.replace(gen_tokens_per_s=40.0, steps=100)
    fresh = simulate_async(cfg.replace(recency_m=1.0)).staleness.mean()
    uniform = simulate_async(cfg.replace(recency_m=0.0)).staleness.mean()
    assert fresh < uniform


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_utilisation_fractions_sum_to_one_per_role(mode):
    cfg = preset("gsm8k_4gpu").replace(steps=50, gen_cv=0.5, learner_cv=0.3)
    for role, fr in simulate(cfg, mode).utilisation.items():
        assert set(fr) == set(STATES)
        assert sum(fr.values()) == pytest.approx(1.0), role
        assert all(v >= -1e-12 for v in fr.values()), (role, fr)


def test_same_seed_same_result_other_seed_differs():
    cfg = preset("gsm8k_4gpu").replace(steps=40, gen_cv=0.3, learner_cv=0.2, recency_m=0.5)
    a, b = compare(cfg), compare(cfg)
    c = compare(cfg.replace(seed=1))
    for mode in ("sync", "async"):
        assert a[mode].wall_s == b[mode].wall_s
        assert np.array_equal(a[mode].staleness, b[mode].staleness)
    assert c["async"].wall_s != a["async"].wall_s


def test_sync_cost_model_and_validation():
    cfg = SimConfig(model_params=1e9, bytes_per_param=2, link_gb_per_s=10, sync_latency_s=0.5,
                        engine_tp=4, apply_gb_per_s=5)
    assert cfg.sync_cost_s == pytest.approx(0.5 + 2e9 / 10e9)
    assert cfg.apply_cost_s == pytest.approx(2e9 / 4 / 5e9)
    assert cfg.replace(sync_s=3.0).sync_cost_s == 3.0
    with pytest.raises(ValueError, match="cannot exceed"):
        SimConfig(k=30, samples_per_prompt=24)
    with pytest.raises(ValueError, match="gen_tokens_per_s"):
        SimConfig(gen_tokens_per_s=0)


def test_more_engines_in_colocated_sync_mode():
    cfg = BASE.replace(num_learners=2, sync_colocated=True)  # 2 + 2 engines
    assert simulate_sync(cfg).wall_s == pytest.approx(20 * (0.5 * 2 + 2.0 + 0.5))


MEASURED = {"gen_samples_per_s": 10.0, "learner_step_s": 2.0, "sync_s": 0.5, "samples_per_prompt": 4,
            "k": 2, "prompts_per_step": 5, "num_searchers": 2, "sync_every": 2, "steps": 10,
            "measured_speedup": 1.5}


def test_calibrate_predicts_the_hand_computed_ratio():
    out = calibrate(MEASURED)
    # sync: 5 prompts x 4 samples / (2 x 10 samples/s) = 1 s gen + 2 s train + 0.5 s sync, 10 times
    assert out["sync_wall_s"] == pytest.approx(35.0)
    # async: first round (4 samples / 10 per s) then learner-bound: 10 steps + 5 syncs
    assert out["async_wall_s"] == pytest.approx(0.4 + 20.0 + 2.5)
    assert out["predicted_speedup"] == pytest.approx(35.0 / 22.9)
    assert out["relative_error"] == pytest.approx(35.0 / 22.9 / 1.5 - 1)
    per_mode = calibrate({**MEASURED, "async_mode": {"learner_step_s": 3.0}})
    assert per_mode["async_wall_s"] == pytest.approx(0.4 + 30.0 + 2.5)
    with pytest.raises(ValueError, match="lacks"):
        calibrate({"k": 2})


def test_presets_run_and_async_wins():
    for name in PRESETS:
        r = compare(preset(name).replace(steps=60))
        assert r["speedup"] > 1.0, name


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/simulate.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=True)


def test_cli_runs_writes_pngs_and_lists_assumptions(tmp_path):
    out = _cli("run", "--preset", "gsm8k_4gpu", "--steps", "40", "--sweep-points", "3",
               "--out", str(tmp_path))
    assert "speed-up (sync / async time)" in out.stdout and "assumptions:" in out.stdout
    for name in ("sim_util.png", "sim_staleness.png", "sim_speedup.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"learner_step_s": 1.0, "steps": 10, "gen_samples_per_s": 3.0}))
    report = json.loads(_cli("run", "--from-json", str(costs), "--num-searchers", "5", "--json").stdout)
    assert report["config"]["num_searchers"] == 5 and report["costs"]["learner_step_s"] == 1.0
    assert report["config"]["gen_tokens_per_s"] == 3.0 * report["config"]["tokens_per_sample"]
    assert report["sync"]["staleness"]["max"] == 0 and report["assumptions"]
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(MEASURED))
    assert "relative error" in _cli("calibrate", str(measured)).stdout


def test_imports_without_torch_or_mpi():
    code = ("import sys; sys.path.insert(0, 'tools'); "
            "import simulator.calibration, simulator.presets, simulator.schedules; "
            "print([m for m in ('torch', 'mpi4py', 'deepspeed', 'vllm') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"
