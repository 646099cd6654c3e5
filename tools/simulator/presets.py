"""Named layouts to simulate; each note says where its costs come from (assumed, not measured)."""
from __future__ import annotations

from simulator.config import SimConfig

PRESETS: dict[str, tuple[dict, str]] = {
    "gsm8k_4gpu": (dict(
        gen_tokens_per_s=8000.0, tokens_per_sample=512, prompt_tokens=150, samples_per_prompt=24, k=20,
        prompts_per_step=7, prompts_per_round=1, learner_tokens_per_s=15000.0, model_params=1.1e9,
        bytes_per_param=2, link_gb_per_s=50.0, sync_latency_s=1.0, apply_gb_per_s=25.0, sync_every=2,
        recency_m=0.95, num_searchers=3, num_learners=1, steps=700, warm_start_samples=500,
        gen_cv=0.1, learner_cv=0.05),
        "The paper's GSM8K layout: RhoMath-1B (1.1B parameters), 1 learner + 3 searchers on 4 x A100, "
        "K=20, S=24, 7 prompts per step, k=2, m=0.95, 700 steps, 512-token responses (the cap) and "
        "~150-token prompts. ASSUMED rates, not measured: vLLM at 8,000 generated tokens/s per A100 "
        "for a 1B model at high concurrency; the learner at 15,000 tokens/s (~8 GFLOP per token for "
        "policy forward+backward and a reference forward, at ~40% of an A100's 312 bf16 TFLOP/s), "
        "which puts a step at ~6.2 s - consistent with the paper's 82 minutes for 700 steps; sync "
        "1 s + 2.2 GB (bf16) at 50 GB/s over NVLink, apply at 25 GB/s (PCIe host-to-device)."),
    "gsm8k_16gpu": (dict(
        gen_tokens_per_s=8000.0, tokens_per_sample=512, prompt_tokens=150, samples_per_prompt=24, k=20,
        prompts_per_step=7, prompts_per_round=1, learner_tokens_per_s=13500.0, model_params=1.1e9,
        bytes_per_param=2, link_gb_per_s=25.0, sync_latency_s=1.5, apply_gb_per_s=25.0, sync_every=2,
        recency_m=0.95, num_searchers=12, num_learners=4, steps=700, warm_start_samples=2000,
        gen_cv=0.1, learner_cv=0.05),
        "16 x A100 (2 nodes of 8): 4 learner ranks (ZeRO-3, 7 prompts each: batch 28 prompts) + 12 "
        "searchers, otherwise the GSM8K preset. ASSUMED: the learner rate drops 10% per rank "
        "(13,500 tokens/s) for ZeRO-3 gathers; the sync crosses nodes (25 GB/s effective, 1.5 s "
        "latency); warm start 500 samples per shard."),
    "llama70b_128gpu": (dict(
        gen_tokens_per_s=2000.0, tokens_per_sample=512, prompt_tokens=150, samples_per_prompt=24, k=20,
        prompts_per_step=1, prompts_per_round=12, learner_tokens_per_s=195.0, model_params=70.55e9,
        bytes_per_param=2, link_gb_per_s=12.5, sync_latency_s=5.0, apply_gb_per_s=25.0, engine_tp=4,
        sync_every=2, recency_m=0.95, num_searchers=16, num_learners=64, steps=2000,
        warm_start_samples=32000, gen_cv=0.1, learner_cv=0.05),
        "The planner's tba_70b preset (configs/experiment/tba_70b.yaml): Llama-3.1-70B on 16 nodes x "
        "8 x 80 GB A100; 8 learner nodes = 64 ZeRO-3 ranks with 1 prompt each (batch 64 prompts x "
        "K=20), 8 searcher nodes = 16 vLLM engines of TP 4, 12 prompts per round, S=24, k=2, 2000 "
        "steps. ASSUMED: 2,000 generated tokens/s per TP-4 engine; 195 tokens/s per learner GPU "
        "(~560 GFLOP per token at ~35% MFU); sync 5 s + 141 GB (bf16) at 12.5 GB/s effective "
        "(gather under ZeRO-3 and an inter-node broadcast); each engine GPU applies its 35 GB "
        "shard at 25 GB/s; warm start 500 samples per shard."),
}


def preset(name: str) -> SimConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return SimConfig(**PRESETS[name][0])
