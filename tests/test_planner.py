"""The planner: 70B fits its stated cluster, too-small clusters are refused with the reason, and
its ZeRO-3 model-state figure is printed next to DeepSpeed's own estimator."""
from __future__ import annotations

import json

import pytest

from hpc_tba.config import compose
from hpc_tba.planner import KNOWN_MODELS, PlanOptions, make_plan, model_spec, plan_main

FAST = PlanOptions(deepspeed=False)


def test_parameter_counts_match_the_published_sizes():
    assert KNOWN_MODELS["llama-3.1-70b"].params / 1e9 == pytest.approx(70.55, abs=0.01)
    assert KNOWN_MODELS["llama-3.1-8b"].params / 1e9 == pytest.approx(8.03, abs=0.01)
    assert KNOWN_MODELS["llama-3.2-1b"].params / 1e9 == pytest.approx(1.24, abs=0.01)


def test_tba_70b_fits_16_nodes_of_8_x_80gb():
    plan = make_plan(compose(["+experiment=tba_70b"]), FAST)
    assert plan.fits, plan.problems
    text = "\n".join(plan.lines)
    assert "learner : 8 node(s), 64 ranks = 64 GPUs" in text
    assert "searcher: 8 node(s), 16 engine(s) x TP 4 = 64 GPUs" in text
    # 16 bytes/param of model states over 64 GPUs
    assert plan.model_states_gib == pytest.approx(70.55e9 * 16 / 64 / 2**30, rel=0.01)
    assert plan.learner_gib < 80e9 * 0.9 / 2**30
    assert plan.engine_gib <= 80e9 * 0.85 / 2**30 + 1e-6  # the KV cache takes what is left


def test_tba_8b_fits():
    assert make_plan(compose(["+experiment=tba_8b"]), FAST).fits


@pytest.mark.parametrize("overrides, reason", [
    # 2 learner nodes cannot hold 70B's optimizer states
    (["cluster.nodes=10", "cluster.num_learners=16"], "learner needs"),
    # one 80 GB GPU cannot hold 70B bf16 weights
    (["cluster.nodes=10", "searcher.tensor_parallel_size=1"], "raise searcher.tensor_parallel"),
    # 40 GB GPUs: neither role fits
    (["cluster.gpu_memory_gb=40"], "learner needs"),
    # a layout the topology cannot build
    (["cluster.nodes=12"], "impossible layout"),
])
def test_too_small_clusters_are_refused_with_the_reason(overrides, reason):
    plan = make_plan(compose(["+experiment=tba_70b", *overrides]), FAST)
    assert not plan.fits
    assert any(reason in p for p in plan.problems), plan.problems


def test_offload_moves_optimizer_states_off_the_gpu():
    cfg = compose(["+experiment=tba_70b", "cluster.nodes=10", "cluster.num_learners=16"])
    plan = make_plan(cfg, PlanOptions(deepspeed=False, offload="optimizer"))
    assert plan.fits, plan.problems


def test_embedded_tiny_config_plans_on_cpu():
    plan = make_plan(compose([]), FAST)
    assert plan.fits and plan.lines[0].startswith("plan: tba  model embedded")


def test_architecture_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)))
    spec = model_spec(compose([f"model.path={tmp_path}"]))
    assert (spec.num_layers, spec.num_kv_heads, spec.tie_embeddings) == (4, 2, True)
    with pytest.raises(ValueError, match="--arch"):
        model_spec(compose(["model.path=/nowhere/mystery-model"]))


def test_plan_main_prints_deepspeed_comparison_and_exit_codes(capsys):
    assert plan_main(["+experiment=tba_70b"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "DeepSpeed" in out and "estimate_zero3" in out
    line = next(ln for ln in out.splitlines() if "ZeRO-3 model states per GPU" in ln)
    ours = float(line.split("hpc_tba ")[1].split()[0])
    theirs = float(line.split("vs DeepSpeed ")[1].split()[0])
    assert ours == pytest.approx(theirs, rel=0.15)  # 16 vs DeepSpeed's 18 bytes/param
    assert plan_main(["+experiment=tba_70b", "cluster.gpu_memory_gb=40", "--no-deepspeed"]) == 1
    assert "REFUSED" in capsys.readouterr().out
    assert plan_main(["--bogus"]) == 2
