"""The planner: 70B fits its stated cluster with the preset's learner settings, too-small clusters
and settings are refused with the reason, memory terms follow the fields the roles use (micro
batch, checkpointing, offload, log-prob chunk, reference, staging), the activation count matches
what autograd saves, and the ZeRO-3 model-state figure is printed next to DeepSpeed's own."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hpc_tba.assembly.compose import compose
from hpc_tba.plan.memory import spec_from_hf_config
from hpc_tba.plan.planner import KNOWN_MODELS, PlanOptions, make_plan, model_spec, plan_main

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
    # 18 bytes/param of model states over 64 GPUs: bf16 weights, fp32 gradients (summed across
    # micro-batches in fp32), fp32 master weights + Adam m, v
    assert plan.model_states_gib == pytest.approx(70.55e9 * 18 / 64 / 2**30, rel=0.01)
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
    small = ["+experiment=tba_70b", "cluster.nodes=11", "cluster.num_learners=24"]
    plan = make_plan(compose(small), FAST)
    assert not plan.fits and "learner.offload_optimizer=true" in plan.problems[0]
    plan = make_plan(compose([*small, "learner.offload_optimizer=true"]), FAST)
    assert plan.fits, plan.problems
    assert plan.terms["optimizer"] == 0 and plan.terms["params"] > 0
    both = make_plan(compose([*small, "learner.offload_optimizer=true", "learner.offload_params=true"]), FAST)
    assert both.terms["params"] == 0 and both.terms["reference"] == 0
    assert any("host memory per node for offload" in ln for ln in both.lines)


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
    assert ours == pytest.approx(theirs, rel=0.15)  # 18 bytes/param, as DeepSpeed counts
    assert plan_main(["+experiment=tba_70b", "cluster.gpu_memory_gb=40", "--no-deepspeed"]) == 1
    assert "REFUSED" in capsys.readouterr().out
    assert plan_main(["--bogus"]) == 2
    assert plan_main(["+experiment=tba_70b", "--micro-batch", "4"]) == 2
    assert "learner.micro_batch_size" in capsys.readouterr().err


def test_70b_preset_prints_activation_logit_and_staging_memory(capsys):
    assert plan_main(["+experiment=tba_70b", "--no-deepspeed"]) == 0
    out = capsys.readouterr().out
    for label in ("activations: layer inputs (checkpointing)", "activations: one layer recomputed",
                  "logits: one chunk", "staging on the device", "staging in pinned host memory"):
        assert label in out, label
    plan = make_plan(compose(["+experiment=tba_70b"]), FAST)
    assert (plan.micro_batch, plan.micro_batch_tokens) == (8, 8 * 1024)  # the preset's micro batch
    # TP 4 out of process: the workers stream; no whole version anywhere on a searcher node
    assert plan.staging == "stream" and plan.terms["staging_device"] == plan.terms["staging_host"] == 0
    bucket = max(plan.buckets)
    assert plan.terms["sync_worker"] == max(3 * bucket, plan.terms["worker_layer"] + bucket)  # GPU: no pool
    # on CPU the workers' first two buffers are pooled at the largest bucket's size (worker_sync)
    cpu = make_plan(compose(["searcher.engine_process=true"]), FAST)
    bucket = max(cpu.buckets)
    assert cpu.terms["sync_worker"] == max(3 * bucket, cpu.terms["worker_layer"] + 3 * bucket)


def test_70b_without_checkpointing_is_refused_naming_the_reason(capsys):
    assert plan_main(["+experiment=tba_70b", "--no-deepspeed", "learner.gradient_checkpointing=false"]) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "activations without gradient checkpointing" in out
    assert "learner.gradient_checkpointing=true" in out


def test_terms_follow_the_learner_fields():
    base = ["+experiment=tba_70b"]
    ref = make_plan(compose(base), FAST).terms
    double = make_plan(compose([*base, "learner.micro_batch_size=16"]), FAST).terms
    assert double["activations"] == pytest.approx(2 * ref["activations"], rel=1e-6)
    assert double["logits"] == ref["logits"]  # one chunk, whatever the micro batch
    quarter = make_plan(compose([*base, "learner.logprob_chunk_tokens=256"]), FAST).terms
    assert quarter["logits"] == pytest.approx(ref["logits"] / 4)
    spec = KNOWN_MODELS["llama-3.1-70b"]
    assert ref["logits"] == 1024 * spec.vocab_size * (2 + 4 + 4)  # bf16 head, fp32 log-softmax + grad
    # micro_batch_size 0 = K, and never more than the G x K sequences of a step
    k = make_plan(compose([*base, "learner.micro_batch_size=0"]), FAST)
    assert k.micro_batch == 20
    g = make_plan(compose([*base, "learner.micro_batch_size=64"]), FAST)
    assert g.micro_batch == 20  # prompts_per_step 1 x K 20
    # checkpointing keeps one hidden state per layer and token, plus one layer's full activations
    no_ck = make_plan(compose([*base, "learner.gradient_checkpointing=false"]), FAST).terms
    per_layer_token = sum(spec.layer_activation_bytes_per_token(2).values())
    tokens = 8 * 1024
    head = tokens * spec.hidden_size * 6
    assert no_ck["activations"] == spec.num_layers * per_layer_token * tokens + head
    assert ref["activations"] == spec.num_layers * tokens * spec.hidden_size * 2 + head + per_layer_token * tokens


def test_reference_is_counted_only_when_the_loss_needs_one():
    tb = make_plan(compose(["+experiment=tba_70b"]), FAST)
    topr = make_plan(compose(["+experiment=tba_70b", "algo=topr"]), FAST)
    assert tb.terms["reference"] == pytest.approx(2 * KNOWN_MODELS["llama-3.1-70b"].params / 64)
    assert topr.terms["reference"] == 0
    assert tb.learner_gib - topr.learner_gib == pytest.approx(tb.terms["reference"] / 2**30)


@pytest.mark.parametrize("overrides, mode, device_buckets, host_versions", [
    ([], "stream", 3, 0),  # auto is stream: 2 buckets, 3 while a loader holds both
    (["searcher.staging=device", "searcher.gpu_memory_utilization=0.5"], "device", None, 0),
    (["searcher.staging=stream"], "stream", 3, 0),
    (["searcher.staging=host"], "host", 1, 1),
])
def test_staging_sizes_per_mode(overrides, mode, device_buckets, host_versions):
    plan = make_plan(compose(["+experiment=tba_8b", *overrides]), FAST)
    assert plan.fits, plan.problems
    assert plan.staging == mode
    version, bucket = sum(plan.buckets), max(plan.buckets)
    assert version == KNOWN_MODELS["llama-3.1-8b"].params * 2  # bf16 engines: bf16 on the wire
    want_dev = version + bucket if device_buckets is None else device_buckets * bucket
    assert plan.terms["staging_device"] == want_dev
    assert plan.terms["staging_host"] == host_versions * version


def test_staging_that_cannot_fit_is_refused():
    # in process (out of process the workers stream whatever staging says): 16 GB of bf16 8B
    # weights do not fit in the 4 GB beside vLLM's 85%, nor 8 searchers' versions in 64 GB
    plan = make_plan(compose(["+experiment=tba_8b", "searcher.staging=device"]), FAST)
    assert not plan.fits
    assert any("searcher.staging=device needs" in p and "staging=host or stream" in p for p in plan.problems)
    host = make_plan(compose(["+experiment=tba_8b", "searcher.staging=host", "cluster.host_memory_gb=64"]), FAST)
    assert any("searcher.staging=stream" in p for p in host.problems), host.problems
    assert make_plan(compose(["+experiment=tba_70b", "searcher.staging=device"]), FAST).fits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_activation_count_matches_what_autograd_saves(dtype):
    """The per-layer count (hpc_tba.plan.memory) against the tensors a transformers Llama layer keeps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(dtype)
    b, t = 2, 64
    hidden = model.model.embed_tokens(torch.randint(0, 512, (b, t))).detach().requires_grad_()
    pos = torch.arange(t)[None].expand(b, -1)
    rope = model.model.rotary_emb(hidden, pos)
    saved: dict[int, int] = {}

    def keep(x):
        saved[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
        model.model.layers[0](hidden, position_embeddings=rope, attention_mask=None, position_ids=pos)
    not_activations = {p.untyped_storage().data_ptr() for p in model.parameters()}
    not_activations.add(hidden.untyped_storage().data_ptr())  # the layer input: a boundary
    measured = sum(n for ptr, n in saved.items() if ptr not in not_activations)
    spec = spec_from_hf_config("tiny", cfg.to_dict())
    counted = b * t * sum(spec.layer_activation_bytes_per_token(dtype.itemsize).values())
    assert 0.85 <= measured / counted <= 1.05, (measured, counted)  # a slight over-count is safe


def test_embedded_spec_matches_the_embedded_model(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    from hpc_tba.tasks.embedded import resolve_model_path

    cfg = compose([])
    built = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model, cfg.task))
    assert model_spec(cfg).params == sum(p.numel() for p in built.parameters())
    # before it is built (another cache directory): the recipe gives the same shapes
    unbuilt = compose([f"model.cache_dir={tmp_path}"])
    assert model_spec(unbuilt) == dataclasses.replace(model_spec(cfg), head_dim_override=None)


def test_nccl_buffers_follow_the_environment_and_the_layout():
    """plan_nccl: 10 MiB per connection and channel at NCCL's defaults (4 MiB Simple + 512 KiB LL
    + 4.6875 MiB LL128, to 2 MiB); cluster.env's NCCL settings change it; the rows enter the
    learner's total and the engine's room beside vLLM; a CPU plan has none (gloo)."""
    from hpc_tba.plan.nccl import collective_connections, engine_bytes, learner_bytes, nccl_sizes

    mib = 2**20
    assert nccl_sizes({}) == nccl_sizes({"NCCL_BUFFSIZE": str(4 * mib)})
    assert (nccl_sizes({}).connection_bytes, nccl_sizes({}).channels) == (10 * mib, 32)
    assert nccl_sizes({"NCCL_BUFFSIZE": str(2 * mib)}).connection_bytes == 8 * mib  # 7.1875 -> 8
    assert nccl_sizes({"NCCL_PROTO": "Simple", "NCCL_MAX_NCHANNELS": "8"}) == type(nccl_sizes({}))(4 * mib, 8)
    with pytest.raises(ValueError, match="cluster.env.NCCL_BUFFSIZE='4M' is not an integer"):
        nccl_sizes({"NCCL_BUFFSIZE": "4M"})
    with pytest.raises(ValueError, match="NCCL_PROTO='\\^LL128'.*unknown: \\^LL128"):
        nccl_sizes({"NCCL_PROTO": "^LL128"})
    assert [collective_connections(n) for n in (1, 2, 3, 8, 64)] == [0, 2, 3, 4, 4]

    cfg = compose(["+experiment=tba_70b"])
    every, sync, _, _ = learner_bytes(cfg)
    assert every == 32 * 4 * 10 * mib  # the 64 learners' group: ring + 3 tree connections
    assert sync == 16 * 32 * 10 * mib  # 16 engine groups (one feed each), a ring broadcast each
    assert engine_bytes(cfg) == 32 * 10 * mib
    plan = make_plan(cfg, PlanOptions(deepspeed=False))
    assert plan.terms["nccl"] == every and plan.terms["nccl_sync"] == sync
    assert plan.terms["nccl_engine"] == engine_bytes(cfg)
    row = next(ln for ln in plan.lines if "NCCL buffers, weight sync (rank 0)" in ln)
    assert "5.00 GiB" in row and "16 engine groups of 1 + TP 4" in row
    fewer = make_plan(compose(["+experiment=tba_70b", "+cluster.env.NCCL_MAX_NCHANNELS=8"]),
                      PlanOptions(deepspeed=False))
    assert plan.learner_gib - fewer.learner_gib == pytest.approx((every + sync) * 3 / 4 / 2**30)
    cpu = make_plan(compose([]), PlanOptions(deepspeed=False))
    assert "nccl" not in cpu.terms and not any("NCCL" in ln for ln in cpu.lines)


def test_sync_time_counts_the_star_from_learner_rank_0():
    """plan_sync: out-of-process engines make every engine's feed send the whole version out of
    learner rank 0's node; in-process ones share one ring broadcast (issue 41's star, timed)."""
    from hpc_tba.plan.sync import sync_seconds

    cfg = compose(["+experiment=tba_70b"])
    plan = make_plan(cfg, PlanOptions(deepspeed=False))
    version = sum(plan.buckets)
    out, fast, slow = sync_seconds(cfg, version)
    assert out == 16 * version and cfg.cluster.network_gbit_per_s == 400 and cfg.cluster.nics_per_node == 4
    assert slow == pytest.approx(out / 50e9) and fast == pytest.approx(slow / 4)
    assert plan.sync_s == (fast, slow)
    assert any("learner rank 0's node sends 2257.72 GB (16 x 141.11 GB" in ln for ln in plan.lines)
    ring = make_plan(compose(["+experiment=tba_8b"]), PlanOptions(deepspeed=False))
    assert sync_seconds(compose(["+experiment=tba_8b"]), sum(ring.buckets))[0] == sum(ring.buckets)
    assert any("one ring broadcast to 8 searchers" in ln for ln in ring.lines)
    assert make_plan(compose(["cluster.num_searchers=0"]), PlanOptions(deepspeed=False)).sync_s == (0.0, 0.0)
