"""Task, objective and sampler fit together: TOPR's reward map, tb_logz, offline and A-LoL samplers."""
import json

import numpy as np
import pytest
import torch

from hpc_tba.assembly.compose import compose
from hpc_tba.config import ConfigError
from hpc_tba.losses.dispatch import LossInputs, compute_loss


def _gsm8k_dir(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    return f"task.path={tmp_path}"


def _topr_grads(cfg, rewards):
    logp = torch.full((len(rewards), 3), -1.0, requires_grad=True)
    x = LossInputs(logp=logp, logp_ref=None, logp_behavior=torch.full((len(rewards), 3), -1.0),
                   mask=torch.ones(len(rewards), 3, dtype=torch.bool), rewards=torch.tensor(rewards),
                   group_ids=torch.zeros(len(rewards), dtype=torch.long))
    loss, metrics = compute_loss(cfg, x, step=0)
    loss.backward()
    return logp.grad.sum(-1), metrics


def test_topr_on_gsm8k_gives_wrong_answers_a_negative_weight(tmp_path):
    """algo=topr task=gsm8k (0/1 rewards): a wrong answer is pushed down, not ignored."""
    cfg = compose(["algo=topr", "task=gsm8k", _gsm8k_dir(tmp_path)])
    grad, m = _topr_grads(cfg.algo, [1.0, 0.0])
    assert grad[0] < 0  # descent raises log π of the correct answer
    assert grad[1] > 0  # ... and lowers that of the wrong one (zero before: R − c = 0 − 0)
    assert grad[1].abs() == pytest.approx(grad[0].abs())  # ±1, TOPR's paper, weight 1 at ratio 1
    assert cfg.algo.reward_map == "pm1" and cfg.algo.reward_range == [0.0, 1.0]
    assert m["topr/multiplier_pos"].item() == 1.0 and m["topr/multiplier_neg"].item() == -1.0


def test_topr_reward_map_none_keeps_the_task_units(tmp_path):
    cfg = compose(["algo=topr", "task=gsm8k", _gsm8k_dir(tmp_path), "algo.reward_map=none",
                   "algo.topr_positive_threshold=0.5", "algo.topr_baseline=0.5"])
    grad, m = _topr_grads(cfg.algo, [1.0, 0.0])
    assert grad[0] < 0 < grad[1] and m["topr/multiplier_neg"].item() == -0.5


@pytest.mark.parametrize("overrides, message", [
    (["algo.topr_baseline=0.5"], "ambiguous"),                    # auto: which units?
    (["algo.reward_map=none"], "makes every sample positive"),     # threshold 0 on 0/1 rewards
    (["algo.reward_map=none", "algo.topr_positive_threshold=0.5", "algo.topr_baseline=0"],
     "topr_baseline=0"),                                           # wrong answers get weight 0
    (["algo.reward_map=pm1", "algo.topr_baseline=1.5"], "topr_baseline=1.5"),
    (["algo.reward_map=bogus"], "reward_map='bogus'"),
])
def test_topr_ill_defined_split_is_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(["algo=topr", "task=gsm8k", _gsm8k_dir(tmp_path), *overrides])


def test_reward_map_for_other_tasks_and_objectives(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "p", "response": "r", "reward": -1}) + "\n")
    with pytest.raises(ConfigError, match="declares no reward range"):
        compose(["algo=topr", "task=offline", f"task.path={f}", "cluster.num_searchers=0"])
    cfg = compose(["algo=topr", "task=offline", f"task.path={f}", "task.reward_range=[-1,1]"])
    assert cfg.algo.reward_map == "none"  # already ±1
    cfg = compose(["algo=topr", "task=offline", f"task.path={f}", "task.reward_range=[0,1]"])
    assert cfg.algo.reward_map == "pm1"
    assert compose(["algo=tb"]).algo.reward_map == "none"
    with pytest.raises(ConfigError, match="algo=tb uses the task's rewards"):
        compose(["algo=tb", "algo.reward_map=pm1"])


def test_tb_learned_logz_is_refused_at_composition():
    with pytest.raises(ConfigError, match="tb_logz=learned is not supported"):
        compose(["algo=tb", "algo.tb_logz=learned"])


def test_offline_drops_recency_and_alol_selects_the_advantage_sampler(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "p", "response": "r", "reward": 1}) + "\n")
    off = ["task=offline", f"task.path={f}", "cluster.num_searchers=0"]
    cfg = compose(["algo=sft", *off])
    assert cfg.buffer.sampler == "tba" and cfg.buffer.recency_m == 0.0
    assert compose(["algo=sft", *off, "buffer=tldr"]).buffer.inv_temp == 1.0  # reward priority kept
    assert compose(["algo=alol", *off]).buffer.sampler == "advantage"
    assert compose(["algo=alol"]).buffer.sampler == "advantage"
    assert compose(["algo=alol", "buffer=uniform"]).buffer.sampler == "uniform"  # an explicit choice
    assert compose(["algo=alol", "algo.alol_variant=r_lol"]).buffer.sampler == "tba"


def test_offline_sampler_is_not_stuck_on_the_last_rows_in_file_order(tmp_path):
    """With recency off, a prompt with more than K rows gets all of them over steps."""
    from hpc_tba.buffer import BufferShard
    from hpc_tba.comm.messages import TrajectoryBatch

    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "p", "response": "r", "reward": 1}) + "\n")
    cfg = compose(["algo=sft", "task=offline", f"task.path={f}", "cluster.num_searchers=0"])
    shard = BufferShard(cfg.buffer, shard_id=0, num_shards=1, directory=str(tmp_path / "buf"), seed=0)
    n = 8
    shard.add(TrajectoryBatch(prompt_id=0, prompt_tokens=np.array([1], np.int32),
                              response_tokens=np.arange(3, 3 + n, dtype=np.int32),
                              lengths=np.ones(n, np.int32), rewards=np.ones(n, np.float32),
                              logp_behavior=np.zeros(n, np.float32), policy_version=0,
                              searcher_id=-1, timestamp=0.0))
    seen = set()
    for _ in range(30):
        batch = shard.sample(1, 2, learner_version=0)
        seen.update(int(r[0]) for r in batch.response_tokens)
    assert len(seen) == n  # recency slots would return the same last 2 rows every step
