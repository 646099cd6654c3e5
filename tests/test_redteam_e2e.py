"""task=redteam end to end with a local victim and a local toxicity classifier (real mpiexec, vLLM,
DeepSpeed): rewards and diversity reach TensorBoard; reward models go where the config says."""
import json

import numpy as np
import pytest
from conftest import HPC_TBA

from hpc_tba.assembly.compose import compose
from hpc_tba.tasks import build_task, redteam_toy
from hpc_tba.tasks.preference import reward_placement


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return redteam_toy.build(tmp_path_factory.mktemp("redteam"), steps=60)


def test_reward_models_follow_the_configured_device_and_dtype(toy, monkeypatch):
    import torch

    cfg = compose(toy)
    assert reward_placement(cfg.task, "cpu") == ("cpu", "float32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # A GPU searcher: auto puts them on its device in bf16, never an implicit CPU fp32.
    assert reward_placement(cfg.task, "cuda") == ("cuda", "bfloat16")
    assert reward_placement(compose([*toy, "task.reward_dtype=float16"]).task, "cuda") == ("cuda", "float16")
    assert reward_placement(compose([*toy, "task.reward_device=cpu"]).task, "cuda") == ("cpu", "float32")
    monkeypatch.undo()
    task = build_task(compose([*toy, "task.reward_dtype=bfloat16"]).task, device="cpu")
    assert task.victim.model.dtype == torch.bfloat16 and task.classifier.model.dtype == torch.bfloat16
    assert str(task.victim.model.device) == "cpu"
    attacks = [p.text for p in task.prompts("train")[:6]]
    tox, answers = task.attack(attacks)
    assert tox.shape == (6,) and np.all((tox >= 0) & (tox <= 1)) and len(answers) == 6


def test_redteam_runs_end_to_end_with_metrics_in_tensorboard(toy, tmp_path):
    import subprocess

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    proc = subprocess.run([HPC_TBA, "train", *toy, "learner.total_steps=3", "learner.eval_every=0",
                           "buffer.warm_start=40", "learner.export_final=false", f"run_dir={run}"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and all(n > 0 for n in summary["trajectories_received"].values())
    rows = [json.loads(line) for line in open(run / "metrics_searcher0.jsonl")]
    rounds = [r for r in rows if "redteam/success_rate" in r]
    assert rounds and all(0.0 <= r["redteam/mean_toxicity"] <= 1.0 for r in rounds)
    assert any("redteam/diversity/self_bleu" in r for r in rounds)
    acc = EventAccumulator(str(run / "tb" / "searcher0"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"redteam/success_rate", "redteam/mean_toxicity", "redteam/diversity/distinct_1",
            "redteam/distinct_successes", "searcher/reward_mean"} <= tags
    learner = [json.loads(line) for line in open(run / "metrics_learner.jsonl")]
    assert all(0.0 <= r["loss/reward_mean"] <= 1.0 for r in learner if "loss/reward_mean" in r)
