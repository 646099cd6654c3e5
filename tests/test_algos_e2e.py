"""Every objective runs the embedded default end to end (real mpiexec, vLLM, DeepSpeed), and
TOPR / A-LoL train fully offline from a file with no searcher rank."""
import json
import math
import subprocess
import sys

import pytest
from conftest import HPC_TBA, REPO

# One searcher: each objective needs one pass through the real components, and a second engine
# on two cores made each run ~1.8x longer (36 s vs 20 s); several searchers are exercised by
# test_spine_e2e, test_two_learners_e2e and test_first_hour.
SHORT = ["learner.total_steps=3", "learner.eval_every=0", "buffer.warm_start=50",
         "learner.export_final=false", "cluster.num_searchers=1"]
# 0/1 rewards in the task's own units (the default, reward_map=auto, maps them to ±1 instead).
TOPR_01 = ["algo.reward_map=none", "algo.topr_positive_threshold=0.5", "algo.topr_baseline=0.5"]


def _train(run_dir, *args, timeout=600):
    proc = subprocess.run([HPC_TBA, "train", *args, f"run_dir={run_dir}"], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in open(run_dir / "metrics_learner.jsonl")]
    return json.loads((run_dir / "summary.json").read_text()), [r for r in rows if "loss/total" in r]


@pytest.mark.parametrize("algo", ["topr", "alol", "grpo", "rloo", "dpo", "sft"])
def test_algo_runs_the_embedded_default(algo, tmp_path):
    extra = TOPR_01 if algo == "topr" else []
    summary, steps = _train(tmp_path / "run", f"algo={algo}", *extra, *SHORT)
    assert summary["steps"] == 3 and len(steps) == 3
    assert all(math.isfinite(r["loss/total"]) for r in steps)
    assert all(n > 0 for n in summary["trajectories_received"].values())


@pytest.fixture(scope="module")
def offline_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("offline")
    data = d / "data.jsonl"
    subprocess.run([sys.executable, f"{REPO}/tools/make_offline_data.py", str(data),
                    "--samples", "4", "--max-prompts", "200"], check=True, capture_output=True,
                   timeout=600)
    proc = subprocess.run([HPC_TBA, "preprocess", "task=offline", f"task.path={data}",
                           "searcher.temperature=1.0"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(d / "data.preprocessed.jsonl")]
    assert len(rows) == 800
    assert all({"logp_behavior", "logp_ref", "advantage"} <= set(r) for r in rows)
    assert all(r["logp_behavior"] <= 0 for r in rows)
    return data


@pytest.mark.parametrize("algo, extra", [("topr", TOPR_01), ("alol", [])])
def test_offline_training_without_searchers(algo, extra, offline_file, tmp_path):
    run_dir = tmp_path / "run"
    summary, steps = _train(run_dir, f"algo={algo}", *extra, "task=offline",
                            f"task.path={offline_file}", "cluster.num_searchers=0",
                            "searcher.temperature=1.0", "learner.total_steps=4",
                            "buffer.warm_start=50")
    assert summary["steps"] == 4 and summary["trajectories_received"] == {}
    assert all(math.isfinite(r["loss/total"]) for r in steps)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")  # the export loads
    assert sum(p.numel() for p in model.parameters()) > 0


def test_offline_task_with_searchers_is_refused(offline_file, tmp_path):
    proc = subprocess.run([HPC_TBA, "train", "algo=topr", *TOPR_01, "task=offline",
                           f"task.path={offline_file}", f"run_dir={tmp_path}/run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "cluster.num_searchers=0" in proc.stderr.strip().splitlines()[-1]
