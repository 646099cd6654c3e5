"""The papers' presets: each composes, carries its paper's hyper-parameters (ALGORITHMS.md), plans
on its own cluster with a tiny local model of the same architecture in `model.path`, and runs a
few steps on this machine with that stand-in and the tiny local pieces its task needs (reward
model, victim and toxicity classifier, offline data). gsm8k_rho1b, topr_offline, redteam_gpt2 and
tldr_pythia run in the default suite; alol_hh, tba_8b and tba_70b behind `long`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import HPC_TBA

from hpc_tba.assembly.compose import compose
from hpc_tba.models.stand_ins import build_reward_model, build_stand_in
from hpc_tba.plan.planner import PlanOptions, make_plan

PRESETS = {  # preset -> architecture of its paper's model
    "gsm8k_rho1b": "llama", "tldr_pythia": "gpt_neox", "redteam_gpt2": "gpt2",
    "topr_offline": "llama", "alol_hh": "llama", "tba_8b": "llama", "tba_70b": "llama"}
PAPER = {  # dotted field -> the paper's value
    "gsm8k_rho1b": {"algo.name": "tb", "task.name": "gsm8k", "learner.prompts_per_step": 7, "searcher.k": 20,
                    "searcher.samples_per_prompt": 24, "searcher.temperature": 0.7, "learner.sync_every": 2,
                    "buffer.recency_m": 0.95, "buffer.inv_temp": 0.0, "buffer.warm_start": 500,
                    "algo.beta0": 0.012, "algo.beta_final": 0.004, "algo.beta_steps": 500, "learner.lr": 1e-5,
                    "learner.grad_clip": 0.0, "searcher.max_new_tokens": 512, "cluster.num_learners": 1,
                    "cluster.num_searchers": 3, "learner.total_steps": 1000},
    "tldr_pythia": {"algo.name": "tb", "task.name": "preference", "algo.beta0": 1.0, "algo.beta_final": 0.05,
                    "algo.beta_steps": 32, "learner.sync_every": 10, "buffer.recency_m": 0.5,
                    "buffer.inv_temp": 1.0, "buffer.warm_start": 10000},
    "redteam_gpt2": {"algo.name": "tb", "task.name": "redteam", "algo.beta0": 0.05, "algo.beta_final": 0.05,
                     "learner.sync_every": 10, "buffer.recency_m": 0.5, "buffer.capacity": 150000,
                     "buffer.eviction": "oldest"},
    "topr_offline": {"algo.name": "topr", "task.name": "offline", "learner.lr": 5e-7, "learner.grad_clip": 1.0,
                     "searcher.temperature": 1.0, "searcher.k": 16, "algo.topr_pos_min": 1.0,
                     "algo.topr_pos_max": 1.0, "algo.topr_neg_min": 0.0, "algo.topr_neg_max": 1.0,
                     "cluster.num_searchers": 0},
    "alol_hh": {"algo.name": "alol", "task.name": "offline", "algo.alol_variant": "a_lol",
                "algo.alol_clip_eps": 0.9, "buffer.sampler": "advantage", "cluster.num_searchers": 0},
    "tba_8b": {"task.chat_template": "on"},
    "tba_70b": {"task.chat_template": "on"},
}


TASK_FIELDS = {"tba_8b": "chat_template", "tba_70b": "chat_template", "topr_offline": "reward_range"}
"""Presets that set a task field the `tasks` branch adds (issue 19): composed once it is merged."""


def _needs_task_fields(preset: str) -> None:
    import dataclasses

    from hpc_tba.config import TaskConfig

    field = TASK_FIELDS.get(preset)
    if field and field not in {f.name for f in dataclasses.fields(TaskConfig)}:
        pytest.skip(f"task.{field} is not in this tree's TaskConfig yet (the tasks branch adds it)")


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stand_ins")
    out = {a: str(build_stand_in(root / a, a)) for a in set(PRESETS.values())}
    out["llama_chat"] = str(build_stand_in(root / "llama_chat", "llama", chat=True))
    return out


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_with_its_papers_values_and_plans(preset, stand_ins):
    _needs_task_fields(preset)
    cfg = compose([f"+experiment={preset}", f"model.path={stand_ins[PRESETS[preset]]}"])
    assert cfg.name == preset
    assert cfg.model.path == stand_ins[PRESETS[preset]]
    wrong = {k: (_get(cfg, k), v) for k, v in PAPER[preset].items()
             if not (_get(cfg, k) == pytest.approx(v) if isinstance(v, float) else _get(cfg, k) == v)}
    assert not wrong, wrong  # field: (preset's value, paper's value)
    plan = make_plan(cfg, PlanOptions(deepspeed=False))
    assert plan.fits, plan.problems
    assert f"plan: {preset}" in plan.lines[0]


def test_presets_point_at_local_paths():
    for preset in PRESETS:
        if preset in TASK_FIELDS and TASK_FIELDS[preset] not in compose([]).task.__dataclass_fields__:
            continue  # composed once the tasks branch is in (the test above says so)
        cfg = compose([f"+experiment={preset}"])
        paths = [cfg.model.path, cfg.task.path, cfg.task.reward_model, cfg.task.victim_model]
        assert all(p == "" or p.startswith("/shared/") for p in paths), (preset, paths)
        assert cfg.model.path.startswith("/shared/models/") and cfg.task.path.startswith("/shared/data/")


# ---------------------------------------------------------------- a few steps with the stand-in

LOCAL = ["cluster=local", "cluster.gpus_per_node=0", "cluster.nodes=1", "cluster.pin_cores=false",
         "learner.dtype=fp32", "searcher.dtype=float32", "learner.eval_every=0", "learner.export_final=false"]
GSM8K = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
          "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(3, 15) for b in (2, 5)]


def _train(run_dir, *overrides: str) -> dict:
    cmd = [HPC_TBA, "train", *LOCAL, *overrides, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((run_dir / "summary.json").read_text())


def _write_jsonl(path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_gsm8k_rho1b_runs_a_few_steps_with_a_tiny_llama(stand_ins, tmp_path):
    data = tmp_path / "gsm8k"
    _write_jsonl(data / "train.jsonl", GSM8K)
    _write_jsonl(data / "test.jsonl", GSM8K[:4])
    summary = _train(tmp_path / "run", "+experiment=gsm8k_rho1b", f"model.path={stand_ins['llama']}",
                     f"task.path={data}", "cluster.num_searchers=1", "learner.total_steps=4",
                     "learner.prompts_per_step=2", "searcher.k=4", "searcher.samples_per_prompt=5",
                     "searcher.prompts_per_round=4", "searcher.max_new_tokens=8", "searcher.max_model_len=128",
                     "buffer.warm_start=10", "learner.sync_check=true")
    assert summary["steps"] == 4 and summary["final_version"] == 4
    gaps = [g for by_version in summary["sync_logprob_gap"].values() for g in by_version.values()]
    assert gaps and max(gaps) < 1e-4, summary["sync_logprob_gap"]


def test_topr_offline_runs_a_few_steps_with_a_tiny_llama(stand_ins, tmp_path):
    _needs_task_fields("topr_offline")
    rows = [{"prompt": f"{a}+{b}=", "response": str(a + b + (i % 2)), "reward": 1.0 if i % 2 == 0 else -1.0}
            for i, (a, b) in enumerate((a, b) for a in range(6) for b in range(6))]
    data = tmp_path / "topr.jsonl"
    _write_jsonl(data, rows)
    model = f"model.path={stand_ins['llama']}"
    pre = subprocess.run([HPC_TBA, "preprocess", "+experiment=topr_offline", model, f"task.path={data}",
                          *LOCAL], capture_output=True, text=True, timeout=600)
    assert pre.returncode == 0, pre.stdout[-2000:] + pre.stderr[-4000:]
    preprocessed = data.with_name("topr.preprocessed.jsonl")
    assert preprocessed.is_file()
    summary = _train(tmp_path / "run", "+experiment=topr_offline", model, f"task.path={preprocessed}",
                     "cluster.num_learners=2", "learner.total_steps=3", "learner.prompts_per_step=2",
                     "searcher.k=1")
    assert summary["steps"] == 3


def _gaps(summary) -> list[float]:
    return [g for by_version in summary["sync_logprob_gap"].values() for g in by_version.values()]


ONLINE = ["learner.total_steps=4", "learner.prompts_per_step=2", "searcher.k=4", "searcher.samples_per_prompt=5",
          "searcher.prompts_per_round=4", "searcher.max_model_len=128", "buffer.warm_start=10",
          "learner.sync_every=2", "learner.sync_check=true", "cluster.num_searchers=1"]
"""The online presets shrunk to a few steps, with two syncs checked against the engine."""


def _run_online(run_dir, preset: str, model: str, *overrides: str) -> dict:
    summary = _train(run_dir, f"+experiment={preset}", f"model.path={model}", *ONLINE, *overrides)
    assert summary["steps"] == 4 and summary["final_version"] == 4
    gaps = _gaps(summary)
    assert len(gaps) >= 2 and max(gaps) < 1e-4, summary["sync_logprob_gap"]
    assert sum(summary["trajectories_received"].values()) > 0, summary
    return summary


TLDR = [{"prompt": f"SUBREDDIT: r/relationships TITLE: advice {i} POST: my friend never answers. TL;DR:",
         "reference": " my friend ignores me"} for i in range(12)]


def test_tldr_pythia_runs_a_few_steps_with_a_tiny_gpt_neox_and_reward_model(stand_ins, tmp_path):
    data = tmp_path / "tldr"
    _write_jsonl(data / "train.jsonl", TLDR)
    _write_jsonl(data / "test.jsonl", TLDR[:4])
    rm = build_reward_model(tmp_path / "rm", "gpt_neox")
    _run_online(tmp_path / "run", "tldr_pythia", stand_ins["gpt_neox"], f"task.path={data}",
                f"task.reward_model={rm}", "searcher.max_new_tokens=12")


def test_redteam_gpt2_runs_a_few_steps_with_a_tiny_gpt2_victim_and_classifier(stand_ins, tmp_path):
    from hpc_tba.tasks import redteam_toy

    task = [o for o in redteam_toy.build(tmp_path / "redteam", steps=60) if not o.startswith("task=")]
    _run_online(tmp_path / "run", "redteam_gpt2", stand_ins["gpt2"], *task, "searcher.max_new_tokens=8")


@pytest.mark.long
@pytest.mark.parametrize("preset", ["tba_8b", "tba_70b"])
def test_instruct_presets_run_a_few_steps_with_a_tiny_chat_llama(preset, stand_ins, tmp_path):
    """The Instruct presets' prompts through the stand-in's chat template, 2 learners (ZeRO-3),
    their learner memory settings (gradient checkpointing, chunked log-probs) kept."""
    data = tmp_path / "gsm8k"
    _write_jsonl(data / "train.jsonl", GSM8K)
    _write_jsonl(data / "test.jsonl", GSM8K[:4])
    _run_online(tmp_path / "run", preset, stand_ins["llama_chat"], f"task.path={data}", "cluster.num_learners=2",
                "searcher.tensor_parallel_size=1", "learner.micro_batch_size=2", "cluster.threads_per_rank=1",
                "searcher.max_new_tokens=8", "searcher.max_model_len=192")
    # what was trained on: every prompt a user turn of the template, with one BOS (the tokenizer's)
    from transformers import AutoTokenizer

    from hpc_tba.buffer.segments import TrajRecord, read_segment

    tok = AutoTokenizer.from_pretrained(stand_ins["llama_chat"])
    head = tok("<|start_header_id|>user<|end_header_id|>", add_special_tokens=False)["input_ids"]
    prompts = [r.prompt_tokens.tolist() for seg in (tmp_path / "run" / "buffer").rglob("seg-*.tbs")
               for r in read_segment(str(seg)).records if isinstance(r, TrajRecord)]
    assert prompts
    bad = [tok.decode(p) for p in prompts if p[:1 + len(head)] != [tok.bos_token_id, *head]
           or p.count(tok.bos_token_id) != 1]
    assert not bad, bad[:2]


HH = [{"prompt": f"Human: How do I bake bread number {i}? Assistant:",
       "response": (" Mix flour, water, salt and yeast, then wait." if i % 3 else " No."),
       "reward": round(0.2 + 0.6 * (i % 3 != 0) + 0.01 * i, 3)} for i in range(18)]


@pytest.mark.long
def test_alol_hh_preprocesses_and_runs_a_few_steps_with_a_tiny_llama(stand_ins, tmp_path):
    data = tmp_path / "hh.jsonl"
    _write_jsonl(data, HH)
    model = f"model.path={stand_ins['llama']}"
    pre = subprocess.run([HPC_TBA, "preprocess", "+experiment=alol_hh", model, f"task.path={data}", *LOCAL],
                         capture_output=True, text=True, timeout=600)
    assert pre.returncode == 0, pre.stdout[-2000:] + pre.stderr[-4000:]
    preprocessed = data.with_name("hh.preprocessed.jsonl")
    rows = [json.loads(line) for line in preprocessed.read_text().splitlines()]
    assert len(rows) == len(HH) and all(r["advantage"] is not None for r in rows)
    summary = _train(tmp_path / "run", "+experiment=alol_hh", model, f"task.path={preprocessed}",
                     "cluster.num_learners=2", "learner.total_steps=3", "learner.prompts_per_step=2")
    assert summary["steps"] == 3


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
