"""The final export: layer by layer into sharded safetensors, never more than one layer gathered.

Two gloo ranks load the embedded model under ZeRO-3, perturb it (so the export cannot pass by
being the original files), export it with a small shard size, and gather the whole model the old
way for comparison. GatheredParameters is instrumented: on every entry the test counts the bytes of
every parameter that is gathered (ZeRO's AVAILABLE status) at that moment, whoever gathered it.
The export must equal the whole-model gather bit for bit, load with transformers' from_pretrained
and with vLLM (whose log-probs match transformers' on the exported weights).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import gloo_deepspeed

from hpc_tba.comm.groups import free_ports

SHARD_BYTES = 300_000  # a decoder block of the embedded model is ~0.8 MB in fp32: several files


def _worker(rank, world, port, src, out_dir, out):
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from hpc_tba.checkpoint import store as checkpoint
    from hpc_tba.config import LearnerConfig
    from hpc_tba.models.loading import load_causal_lm
    from hpc_tba.roles.learner import deepspeed_config

    gloo_deepspeed(rank, world, port)
    cfg = deepspeed_config(LearnerConfig(), micro_batch=1, train=True)
    model = load_causal_lm(src, dtype=torch.float32, zero3_config=cfg, rank=rank)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    module = engine.module
    gen = torch.Generator().manual_seed(1)
    for _, p in module.named_parameters():  # weights no file on disk holds
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if rank == 0:
                p.data.add_(0.01 * torch.randn(p.shape, generator=gen))

    peaks, real = [], deepspeed.zero.GatheredParameters

    class Counting(real):
        def __enter__(self):
            super().__enter__()
            peaks.append(sum(p.ds_numel * p.element_size() for p in module.parameters()
                             if p.ds_status == ZeroParamStatus.AVAILABLE))

    deepspeed.zero.GatheredParameters = Counting
    try:
        checkpoint.export_hf(engine, out_dir, tokenizer_src=src, learner_rank=rank, shard_bytes=SHARD_BYTES)
    finally:
        deepspeed.zero.GatheredParameters = real
    layers = [sum(p.ds_numel * p.element_size() for _, p in ps) for _, ps in checkpoint.layer_groups(module)]
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        whole = {k: v.detach().clone() for k, v in module.state_dict().items()} if rank == 0 else {}
    out[rank] = {"peaks": peaks, "layers": layers, "whole": whole}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from hpc_tba.config import ModelConfig, TaskConfig
    from hpc_tba.tasks.embedded import resolve_model_path

    src = resolve_model_path(ModelConfig(), TaskConfig())
    out_dir = str(tmp_path_factory.mktemp("export") / "final_model")
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(2, free_ports(1)[0], src, out_dir, out), nprocs=2, join=True)
    return src, out_dir, dict(out)


def test_export_never_gathers_more_than_one_layer(exported):
    _, _, out = exported
    for rank in (0, 1):
        peaks, layers = out[rank]["peaks"], out[rank]["layers"]
        assert len(peaks) == len(layers) >= 4  # embedding, 2 blocks, final norm: one gather each
        assert max(peaks) <= max(layers) < sum(layers) / 2, (peaks, layers)


def test_export_is_sharded_and_equals_the_whole_model_gather(exported):
    from safetensors.torch import load_file

    _, out_dir, out = exported
    index = json.load(open(os.path.join(out_dir, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not os.path.exists(os.path.join(out_dir, "model.safetensors"))
    tensors = {}
    for f in files:
        part = load_file(os.path.join(out_dir, f))
        assert os.path.getsize(os.path.join(out_dir, f)) <= SHARD_BYTES + 1_000_000  # one block over at most
        assert {k for k, v in index["weight_map"].items() if v == f} == set(part)
        tensors.update(part)
    whole = out[0]["whole"]
    tied = set(whole) - set(tensors)  # a tied head is written once, as transformers does
    assert tied <= {"lm_head.weight"}
    for k, v in tensors.items():
        assert torch.equal(v, whole[k]), k
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in tensors.values())


def test_export_loads_with_transformers_from_pretrained(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, out_dir, out = exported
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    whole = out[0]["whole"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, whole[k]), k
    assert not torch.equal(original.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert AutoTokenizer.from_pretrained(out_dir).vocab_size == AutoTokenizer.from_pretrained(src).vocab_size
    assert json.load(open(os.path.join(out_dir, "config.json")))["dtype"] == "float32"


def test_export_loads_in_vllm(exported):
    from transformers import AutoModelForCausalLM

    from hpc_tba.config import SearcherConfig
    from hpc_tba.engine.vllm_engine import VLLMEngine, configure_cpu_env

    _, out_dir, _ = exported
    prompt, response = [1, 5, 9, 12, 7], [3, 8, 2, 6]
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    configure_cpu_env(core=None, kv_cache_mb=64)
    engine = VLLMEngine(out_dir, SearcherConfig(max_new_tokens=8), seed=0)
    try:
        got = torch.from_numpy(engine.score(prompt, response, temperature=1.0))
    finally:
        engine.close()
    assert torch.allclose(got, want.float(), atol=1e-4), (got, want)


def test_layer_groups_of_an_untied_llama_without_deepspeed(tmp_path):
    """A plain module (gathers are no-ops): groups are blocks and top-level modules, the untied
    head is written, and the files round-trip."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from hpc_tba.checkpoint.store import export_hf, layer_groups

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    names = [g for g, _ in layer_groups(model)]
    assert names == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
                     "model.norm", "lm_head"]
    export_hf(model, str(tmp_path / "m"), tokenizer_src=None, learner_rank=0, shard_bytes=60_000)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    assert len(os.listdir(tmp_path / "m")) >= 5
