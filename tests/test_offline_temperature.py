"""Offline log-probs are stored at the temperature the learner scores at, and a mismatch is refused."""
import json

import pytest
import torch

from hpc_tba.assembly.compose import compose
from hpc_tba.buffer import BufferShard
from hpc_tba.roles.offline import fill_shard, preprocess_file, sequence_logprobs
from hpc_tba.tasks import build_task
from hpc_tba.tasks.embedded import resolve_model_path
from hpc_tba.tasks.offline import read_offline
from hpc_tba.tasks.records import DataError

ROWS = [{"prompt": "1+2=", "response": "3", "reward": 1.0},
        {"prompt": "1+2=", "response": "4", "reward": 0.0},
        {"prompt": "4+4=", "response": "8", "reward": 1.0}]


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = compose([])
    path = resolve_model_path(cfg.model, cfg.task)
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()


def _data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _cfg(path, temperature):
    return compose(["algo=topr", "task=offline", f"task.path={path}", "task.reward_range=[0,1]",
                    "cluster.num_searchers=0", f"searcher.temperature={temperature}"])


def _shard(cfg, tmp_path, name):
    return BufferShard(cfg.buffer, shard_id=0, num_shards=1, directory=str(tmp_path / name), seed=0)


def test_preprocess_stores_logprobs_at_the_learners_temperature(model, tmp_path):
    path, tok, lm = model
    data = _data(tmp_path)
    cfg = _cfg(data, 0.7)
    out = preprocess_file(str(data), path, temperature=0.7, task_cfg=cfg.task)
    rows = read_offline(out)
    assert all(r.logp_temperature == 0.7 for r in rows)
    want = sequence_logprobs(lm, tok, [r["prompt"] for r in ROWS], [r["response"] for r in ROWS],
                             temperature=0.7)
    at_1 = sequence_logprobs(lm, tok, [r["prompt"] for r in ROWS], [r["response"] for r in ROWS])
    got = [r.logp_behavior for r in rows]
    assert got == pytest.approx(want, abs=1e-5) and got != pytest.approx(at_1, abs=1e-3)
    task = build_task(cfg.task, tokenizer=tok)
    assert fill_shard(_shard(cfg, tmp_path, "ok"), task, tok, needs=["logp_behavior"],
                      temperature=0.7) == 3


def test_learner_refuses_logprobs_at_another_temperature(model, tmp_path):
    path, tok, _ = model
    data = _data(tmp_path)
    preprocess_file(str(data), path, temperature=1.0, task_cfg=_cfg(data, 1.0).task)
    cfg = _cfg(data, 0.7)
    with pytest.raises(DataError, match=r"logp_temperature=1, but the learner scores at "
                                        r"searcher.temperature=0.7"):
        fill_shard(_shard(cfg, tmp_path, "bad"), build_task(cfg.task, tokenizer=tok), tok,
                   needs=["logp_behavior"], temperature=0.7)
    # Preprocessing again at 0.7 recomputes the stale rows (the output is its own input here).
    out = preprocess_file(str(data), path, temperature=0.7, task_cfg=cfg.task)
    assert {r.logp_temperature for r in read_offline(out)} == {0.7}


def test_rows_with_logprobs_of_unknown_temperature_and_rewards_out_of_range(model, tmp_path):
    _, tok, _ = model
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({**ROWS[0], "logp_behavior": -1.0}) + "\n")
    cfg = _cfg(data, 1.0)
    with pytest.raises(DataError, match="no logp_temperature"):
        fill_shard(_shard(cfg, tmp_path, "a"), build_task(cfg.task, tokenizer=tok), tok,
                   needs=["logp_behavior"], temperature=1.0)
    data.write_text(json.dumps({**ROWS[0], "reward": 2.0, "logp_behavior": -1.0,
                                "logp_temperature": 1.0}) + "\n")
    with pytest.raises(DataError, match=r"reward 2 is outside the declared task.reward_range=\[0, 1\]"):
        fill_shard(_shard(cfg, tmp_path, "b"), build_task(cfg.task, tokenizer=tok), tok,
                   needs=["logp_behavior"], temperature=1.0)


def test_preprocess_keeps_given_logprobs_unstamped(tmp_path):
    """A row whose log μ came with the file (temperature unknown) is not stamped with ours."""
    from hpc_tba.tasks.offline import preprocess

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({**ROWS[0], "logp_behavior": -1.0}) + "\n" + json.dumps(ROWS[2]) + "\n")
    out = preprocess(data, behavior_fn=lambda p, r: [-2.0] * len(p),
                     ref_fn=lambda p, r: [-3.0] * len(p), temperature=0.5)
    rows = read_offline(out)
    assert [r.logp_behavior for r in rows] == [-1.0, -2.0]
    assert [r.logp_temperature for r in rows] == [None, 0.5]
    assert torch.isfinite(torch.tensor([r.logp_ref for r in rows])).all()
