"""`hpc-tba plan --dry-run`: the 70B model on the meta device through the learner's and the sender's
own code (manifest, buckets, sender slots, micro-batch shapes, receiver staging), checked against
the plan on CPU in seconds; a planner that drifts from the code is refused."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from hpc_tba.assembly.compose import compose
from hpc_tba.plan.planner import PlanOptions, make_plan, plan_main

DRY = PlanOptions(deepspeed=False, dry_run=True)
CHECKS = ("parameters", "largest layer (export gather)", "weight-sync bytes per version",
          "weight-sync buckets", "largest bucket", "sender staging slots (learner rank 0)",
          "resolves to", "receiver staging", "sequences in the largest micro-batch",
          "tokens in the largest micro-batch")
FEED_CHECKS = ("held versions (learner rank 0's node, host)", "feed device pieces (learner rank 0)")
"""Out-of-process engines: learner rank 0's feeds (comm/weight_sync/feeds.py)."""


def test_70b_dry_run_agrees_with_the_plan_in_seconds(capsys):
    t0 = time.time()
    assert plan_main(["--dry-run", "--no-deepspeed", "+experiment=tba_70b"]) == 0
    assert time.time() - t0 < 60
    out = capsys.readouterr().out
    assert "dry run on the meta device (llama config of llama-3.1-70b, bf16)" in out
    rows = [ln for ln in out.splitlines() if " plan " in ln and " code " in ln]
    for check in CHECKS + FEED_CHECKS:  # TP 4: out-of-process engines, each with its feed
        assert any(check in r and r.endswith("ok") for r in rows), check
    assert "MISMATCH" not in out and out.rstrip().endswith("FITS")
    assert "micro-batches of a worst-case step (1 x 20 sequences of 1024 tokens): 3 x (8, 1024)" in out


@pytest.mark.parametrize("overrides", [
    ["+experiment=tba_8b"],
    ["+experiment=tba_8b", "searcher.staging=device", "searcher.gpu_memory_utilization=0.5"],
    ["+experiment=tba_8b", "searcher.staging=stream", "learner.micro_batch_size=0"],  # K per micro-batch
    [],  # the embedded CPU config
])
def test_dry_run_agrees_on_other_layouts(overrides):
    plan = make_plan(compose(overrides), DRY)
    assert plan.fits, plan.problems
    assert sum(" code " in ln for ln in plan.lines) == len(CHECKS)


def test_packed_micro_batches_are_planned_and_dry_run_by_their_token_budget():
    plan = make_plan(compose(["+experiment=tba_8b", "learner.micro_batch_tokens=8192"]), DRY)
    assert plan.fits, plan.problems
    assert plan.micro_batch_tokens == 8192 and plan.micro_batch == 8  # 8 sequences of 1024 at most
    text = "\n".join(plan.lines)
    assert "32 layers x 8192 tokens (learner.micro_batch_tokens, packed)" in text
    assert "tokens in the largest packed micro-batch (<=)" in text and "MISMATCH" not in text
    padded = make_plan(compose(["+experiment=tba_8b", "learner.micro_batch_size=8"]), DRY)
    assert padded.terms["activations"] == plan.terms["activations"]  # the same tokens, the same bytes


def test_dry_run_agrees_on_cpu_engine_workers():
    """Out-of-process engines on CPU: the workers' pooled host buffers (engine.worker_sync), the
    plan's row against the code's bound; learner rank 0's held versions (none on a device)."""
    plan = make_plan(compose(["searcher.engine_process=true"]), DRY)
    assert plan.fits, plan.problems
    for check in ("engine worker sync buffers (each worker)",) + FEED_CHECKS:
        rows = [ln for ln in plan.lines if check in ln and " code " in ln]
        assert len(rows) == 1 and rows[0].endswith("ok"), rows
    assert sum(" code " in ln for ln in plan.lines) == len(CHECKS) + 1 + len(FEED_CHECKS)
    assert plan.terms["held_versions"] == 2 * sum(plan.buckets) > 0 and plan.terms["feed_buckets"] == 0


def test_held_versions_are_counted_on_learner_rank_0s_node():
    """learner.sync_versions_held copies of the version, in host memory; refused where the node
    has too little; and each of the 70B run's 16 feeds two device pieces on rank 0's GPU."""
    plan = make_plan(compose(["+experiment=tba_70b", "learner.sync_versions_held=3"]), DRY)
    assert plan.fits, plan.problems
    assert plan.terms["held_versions"] == 3 * sum(plan.buckets)
    piece = -(-max(plan.buckets) // 2 // 8) * 2  # bf16: a 2 GiB bucket goes as 8 pieces
    assert plan.terms["feed_buckets"] == 16 * 2 * piece
    small = make_plan(compose(["+experiment=tba_70b", "cluster.host_memory_gb=256"]), DRY)
    assert any("held versions" in p for p in small.problems), small.problems


def test_a_planner_that_drifts_from_the_code_is_refused(monkeypatch):
    import hpc_tba.plan.planner as planner
    real = planner.bucket_sizes
    # a planner that forgot that a bucket closes before the parameter that would overflow it
    monkeypatch.setattr(planner, "bucket_sizes", lambda spec, bucket_bytes, wire_bytes: real(
        spec, bucket_bytes=2 * bucket_bytes, wire_bytes=wire_bytes))
    plan = make_plan(compose(["+experiment=tba_70b"]), DRY)
    assert not plan.fits
    assert any(p.startswith("dry run: weight-sync buckets: the plan says") for p in plan.problems)
    assert make_plan(compose(["+experiment=tba_70b"]), PlanOptions(deepspeed=False)).fits  # no dry run


def test_dry_run_splits_long_sequences_on_the_meta_device(monkeypatch):
    from hpc_tba.roles import parallel

    cfg = compose(["+experiment=tba_70b_long"])
    plan = make_plan(cfg, DRY)
    assert plan.fits, plan.problems
    sp, length = cfg.learner.sequence_parallel_size, cfg.searcher.max_model_len
    assert sp > 1 and any(f"(1, {-(-length // sp)})" in ln for ln in plan.lines
                          if "micro-batches of a worst-case step" in ln)
    seen = []
    real = parallel.SequenceParallel.local_inputs

    def broken(self, input_ids, pad_id=0):  # a split that drops the last rank's last position
        seen.append(input_ids.device.type)
        inputs, start, stop = real(self, input_ids, pad_id)
        return inputs, start, stop - (self.rank == self.size - 1) * (1 + stop - length)

    monkeypatch.setattr(parallel.SequenceParallel, "local_inputs", broken)
    plan = make_plan(cfg, DRY)
    assert set(seen) == {"meta"} and not plan.fits
    assert any("do not tile" in p for p in plan.problems)


def test_dry_run_reads_config_json_when_the_model_is_there(tmp_path):
    """A Qwen2-shaped config.json (q/k/v biases): the spec and the real transformers model agree."""
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=1000, hidden_size=256,
        intermediate_size=512, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False)))
    plan = make_plan(compose([f"model.path={tmp_path}"]), DRY)
    assert plan.fits, plan.problems
    assert any(f"dry run on the meta device ({tmp_path}/config.json" in ln for ln in plan.lines)


def test_cli_dry_run():
    out = subprocess.run([sys.executable, "-m", "hpc_tba.cli.main", "plan", "--dry-run", "--no-deepspeed",
                          "+experiment=tba_70b", "learner.gradient_checkpointing=false"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "activations without gradient checkpointing" in out.stdout
    assert "dry run on the meta device" in out.stdout  # the dry run runs on a refused plan too
