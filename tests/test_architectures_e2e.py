"""The whole loop on tiny random models of real architectures: `hpc-tba train model.path=<dir>`
(mpiexec, vLLM, DeepSpeed ZeRO-3, gloo) with learner.sync_check=true: after every sync the
engine's log-probs on a probe equal the learner's. GPT-NeoX (Pythia's layout, `embed_out` on
disk), hub-layout GPT-2 (tied head, Conv1D) and Qwen2 run by default; the rest behind `long`."""
import json
import subprocess

import pytest
from conftest import HPC_TBA

from hpc_tba.models.stand_ins import build_stand_in

STEPS, SYNC_EVERY = 4, 2
LONG = pytest.mark.long


@pytest.mark.parametrize("arch, layout", [
    ("gpt_neox", "hub"), ("gpt2", "hub"), ("qwen2", "sharded"),
    pytest.param("llama", "bin", marks=LONG), pytest.param("qwen3", "save_pretrained", marks=LONG),
    pytest.param("mistral", "save_pretrained", marks=LONG), pytest.param("gemma", "save_pretrained", marks=LONG),
    pytest.param("phi", "save_pretrained", marks=LONG), pytest.param("olmo", "save_pretrained", marks=LONG)])
def test_the_loop_runs_and_syncs_exactly(arch, layout, tmp_path):
    model = build_stand_in(tmp_path / "model", arch, layout=layout)
    run_dir = tmp_path / "run"
    cmd = [HPC_TBA, "train", f"model.path={model}", f"learner.total_steps={STEPS}",
           f"learner.sync_every={SYNC_EVERY}", "learner.sync_check=true", "learner.eval_every=0",
           "learner.prompts_per_step=4", "searcher.k=4", "searcher.samples_per_prompt=5",
           "searcher.max_new_tokens=6", "buffer.warm_start=20", "cluster.num_searchers=1",
           f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    gaps = summary["sync_logprob_gap"]["1"]
    assert sorted(int(v) for v in gaps) == list(range(SYNC_EVERY, STEPS + 1, SYNC_EVERY)), gaps
    assert max(gaps.values()) < 1e-4, (arch, gaps)
    # the exported policy loads back whole (a tied head exported once, names as on the hub)
    import torch

    from hpc_tba.models.loading import load_causal_lm

    load_causal_lm(str(run_dir / "final_model"), dtype=torch.float32, zero3_config=None, rank=0)
