"""Training a few steps on data in the hub's layouts (issue 27), with the embedded model so that
nothing but a fresh clone is needed: `hpc-tba train task=gsm8k task.path=<the hub cache entry of
openai/gsm8k>` (default suite); HH-RLHF converted by `hpc-tba data hh-rlhf` trained offline with
A-LoL (after `hpc-tba preprocess`) and DPO, and TL;DR converted by `hpc-tba data tldr` trained with
a tiny reward model (behind `long`)."""
from __future__ import annotations

import json
import subprocess

import pytest
from conftest import HPC_TBA
from test_data_convert import hh_download
from test_data_layouts import gsm8k_cache, gsm8k_repo

SHORT = ["learner.total_steps=2", "learner.eval_every=0", "buffer.warm_start=8",
         "learner.export_final=false", "cluster.num_searchers=1", "searcher.max_new_tokens=8"]


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([HPC_TBA, *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_train_gsm8k_from_the_hub_cache_entry_on_a_fresh_clone(tmp_path):
    pytest.importorskip("pyarrow")
    entry = gsm8k_cache(tmp_path / "hub")  # datasets--openai--gsm8k/snapshots/<hash>/main/...
    _run("train", "task=gsm8k", f"task.path={entry}", *SHORT, f"run_dir={tmp_path / 'run'}")
    summary = _summary(tmp_path / "run")
    assert summary["steps"] == 2, summary


def test_train_refuses_a_column_the_data_does_not_have_before_starting(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    from hpc_tba.cli.main import main

    repo = gsm8k_repo(tmp_path / "gsm8k")
    with pytest.raises(SystemExit) as e:  # before mpiexec: no rank starts, no run directory
        main(["train", "task=gsm8k", f"task.path={repo}", "task.columns.question=problem",
              f"run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
    assert "train-00000-of-00001.parquet: field 'question': task.columns.question='problem': no " \
           "such column; the columns found are answer, question" in str(e.value), e.value


@pytest.mark.long
@pytest.mark.parametrize("algo", ["alol", "dpo"])
def test_hh_rlhf_converted_trains_offline(algo, tmp_path):
    src = hh_download(tmp_path / "hh-rlhf")
    _run("data", "hh-rlhf", str(src), str(tmp_path / "hh"))
    data = tmp_path / "hh" / "train.jsonl"
    offline = ["task=offline", "cluster.num_searchers=0", "searcher.temperature=1.0", "searcher.k=2",
               "learner.total_steps=2", "learner.prompts_per_step=2", "learner.eval_every=0",
               "learner.export_final=false", "buffer.warm_start=8"]
    if algo == "alol":
        _run("preprocess", "algo=alol", *offline, f"task.path={data}")
        data = data.with_name("train.preprocessed.jsonl")
    _run("train", f"algo={algo}", *offline, f"task.path={data}", f"run_dir={tmp_path / 'run'}")
    assert _summary(tmp_path / "run")["steps"] == 2


@pytest.mark.long
def test_tldr_converted_trains_with_a_reward_model(tmp_path):
    from hpc_tba.models.stand_ins import build_reward_model

    src = tmp_path / "tldr-src"
    # post/summary rows, short: the embedded model's character-level context is 64 tokens
    rows = [{"post": f"{i} + {i}", "summary": f"{2 * i}"} for i in range(8)]
    for split in ("train", "test"):
        (src / "data").mkdir(parents=True, exist_ok=True)
        (src / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _run("data", "tldr", str(src), str(tmp_path / "tldr"))
    assert json.loads((tmp_path / "tldr" / "train.jsonl").read_text().splitlines()[1]) == \
        {"prompt": "POST: 1 + 1\n\nTL;DR:", "reference": " 2"}
    rm = build_reward_model(tmp_path / "rm", "gpt_neox")
    _run("train", "task=preference", f"task.path={tmp_path / 'tldr'}", f"task.reward_model={rm}",
         *SHORT, f"run_dir={tmp_path / 'run'}")
    assert _summary(tmp_path / "run")["steps"] == 2
