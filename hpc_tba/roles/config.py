"""Typed configurations of the learner and searcher roles (`learner=`, `searcher=` groups)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LearnerConfig:
    """DeepSpeed ZeRO-3 learner."""

    mode: str = "async"
    """async (TBA: train on replay-buffer samples while the searchers keep generating) or sync
    (the on-policy baseline: the searchers generate one batch with the current weights, the
    learner trains on exactly that batch, syncs, and only then do they generate again; needs
    sync_every=1 — the `learner=sync` preset sets both)."""
    total_steps: int = 150
    """Learner updates in the run."""
    prompts_per_step: int = 16
    """Prompts per learner step on each learner rank (each contributes K samples)."""
    micro_batch_size: int = 0
    """Sequences in one forward/backward on one rank; the step's G x K sequences are split into
    micro-batches with gradient accumulation (the update equals the one-batch update). 0: K, one
    prompt group per micro-batch. Learner memory scales with this, never with G."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (transformers' gradient checkpointing)."""
    offload_optimizer: bool = False
    """DeepSpeed ZeRO-3: keep optimizer states (and the step) in host memory."""
    offload_params: bool = False
    """DeepSpeed ZeRO-3: keep parameter shards in host memory between uses."""
    logprob_chunk_tokens: int = 1024
    """Token positions per chunk when computing the log-probs of chosen tokens: the fp32
    log-softmax never spans more than this many positions over the whole vocabulary."""
    lr: float = 3e-5
    """Adam learning rate (TBA uses Adam, no gradient clipping)."""
    warmup_steps: int = 10
    """Linear learning-rate warm-up steps."""
    grad_clip: float = 0.0
    """Gradient-norm clip; 0 disables it (the TBA authors use none)."""
    sync_every: int = 2
    """k: broadcast weights to the searchers every k learner steps (GSM8K: 2)."""
    sync_bucket_mb: float = 64.0
    """Size of one weight-sync bucket in MiB."""
    sync_wire_dtype: str = "auto"
    """dtype of weights on the wire: auto (the engines' dtype, searcher.dtype), fp32, or bf16
    (half the bytes; what bf16 engines on GPUs run in anyway)."""
    eval_every: int = 50
    """Held-out evaluation every this many steps (0: only before and after)."""
    log_every: int = 1
    """TensorBoard scalars every this many steps."""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage (3 shards parameters, gradients and optimizer states)."""
    dtype: str = "fp32"
    """Training dtype: fp32 or bf16."""
    seed: int = 0
    """Seed of sampling from the buffer and of torch on the learner."""
    sync_check: bool = False
    """Debug: after every sync, compare the engines' log-probs on a probe with the learner's."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps (0: only on preemption signals and at the end)."""
    checkpoint_interval_s: float = 0.0
    """Also checkpoint when this many seconds passed since the last one (0: off)."""
    keep_last: int = 2
    """Complete checkpoints kept (older ones are deleted after a new one is in place)."""
    max_nonfinite_steps: int = 5
    """Consecutive NaN/inf losses (each skipped) after which the run stops with an error."""
    export_final: bool = True
    """Write the final policy as a Hugging Face directory `<run_dir>/final_model`."""

    def __post_init__(self) -> None:
        if self.total_steps < 1 or self.prompts_per_step < 1:
            raise ValueError("learner.total_steps and learner.prompts_per_step must be >= 1")
        if self.sync_every < 1:
            raise ValueError("learner.sync_every (k) must be >= 1")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"learner.mode={self.mode!r} must be async or sync")
        if self.mode == "sync" and self.sync_every != 1:
            raise ValueError(f"learner.mode=sync trains only on samples of the current weights, so "
                             f"it syncs after every step: set learner.sync_every=1 (got "
                             f"{self.sync_every}), or use the preset learner=sync")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"learner.zero_stage={self.zero_stage} must be 0-3")
        if self.checkpoint_every < 0 or self.checkpoint_interval_s < 0 or self.keep_last < 1:
            raise ValueError("learner.checkpoint_every/checkpoint_interval_s must be >= 0 and "
                             "learner.keep_last >= 1")
        if self.sync_wire_dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(f"learner.sync_wire_dtype={self.sync_wire_dtype!r} must be auto, fp32 or bf16")
        if self.micro_batch_size < 0 or self.logprob_chunk_tokens < 1:
            raise ValueError("learner.micro_batch_size must be >= 0 (0: K) and "
                             "learner.logprob_chunk_tokens >= 1")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"learner.dtype={self.dtype!r} must be fp32 or bf16")


@dataclasses.dataclass
class SearcherConfig:
    """vLLM searcher: generates S samples per prompt and ships them all; the learner takes K."""

    samples_per_prompt: int = 12
    """S: responses generated per prompt (the paper: S = 1.2 K)."""
    k: int = 10
    """K: responses of one prompt in one learner micro-batch (TB's logZ group)."""
    temperature: float = 0.7
    """Sampling temperature; log-probs on both sides come from logits / temperature."""
    prompts_per_round: int = 8
    """Prompts per generation round."""
    update: str = "between_rounds"
    """When an engine applies a new weight version: between_rounds (a response never mixes
    versions) or in_flight (running requests continue on the new weights between decode steps;
    every response token carries the version that produced it)."""
    staging: str = "auto"
    """Where a received weight version waits for the engine: device (one version in the engine's
    dtype on its GPU), host (pinned host memory), stream (bucket by bucket straight into the
    engine), or auto (device when the plan says it fits, else host; host on CPU)."""
    max_version_span: int = 0
    """in_flight: most weight versions one response may carry; a response whose tokens come from
    more versions is dropped (counted in searcher/dropped_version_span). 0: no cap (keep all:
    the behaviour log-prob of every token is exact for the version stamped on it)."""
    stop: list[str] = dataclasses.field(default_factory=list)
    """Stop strings ending a response besides the tokenizer's EOS (the stop string is kept)."""
    enforce_eager: bool | None = None
    """vLLM without CUDA graphs; None: eager on CPU, CUDA graphs on GPU."""
    max_new_tokens: int = 8
    """Longest response."""
    max_model_len: int = 64
    """vLLM max sequence length."""
    kv_cache_mb: int = 64
    """KV-cache size per engine in MiB (vLLM would otherwise reserve most of RAM on CPU)."""
    gpu_memory_utilization: float = 0.85
    """GPU engines: fraction of device memory vLLM may use."""
    tensor_parallel_size: int = 1
    """GPU engines: GPUs one engine spans."""
    engine_process: bool = False
    """Run the vLLM engine in child processes (vLLM V1 multiprocessing) instead of inside the
    searcher's process; weights reach its workers over a per-engine channel. Always on when
    tensor_parallel_size > 1 (vLLM's tensor-parallel workers are processes of their own)."""
    dtype: str = "float32"
    """Engine dtype (float32 on CPU so the engine's log-probs match the learner's)."""
    seed: int = 0
    """Base seed; searcher i uses seed + i."""

    def __post_init__(self) -> None:
        if self.samples_per_prompt < 1 or self.k < 1:
            raise ValueError("searcher.samples_per_prompt (S) and searcher.k (K) must be >= 1")
        if self.temperature <= 0:
            raise ValueError(f"searcher.temperature={self.temperature} must be > 0")
        if self.max_new_tokens < 1 or self.max_model_len <= self.max_new_tokens:
            raise ValueError("searcher.max_model_len must exceed searcher.max_new_tokens >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"searcher.tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.update not in ("between_rounds", "in_flight"):
            raise ValueError(f"searcher.update={self.update!r} must be between_rounds or in_flight")
        if self.staging not in ("auto", "device", "host", "stream"):
            raise ValueError(f"searcher.staging={self.staging!r} must be auto, device, host or stream")
        if self.max_version_span < 0:
            raise ValueError(f"searcher.max_version_span={self.max_version_span} must be >= 0 (0: no cap)")
        if self.tensor_parallel_size > 1:
            self.engine_process = True  # tensor-parallel workers always live in other processes
        if self.staging == "stream" and self.engine_process:
            raise ValueError("searcher.staging=stream loads buckets straight into an in-process "
                             "engine; with engine_process=true (or tensor_parallel_size > 1) use "
                             "staging=device, host or auto")


def resolve_wire_dtype(learner: LearnerConfig, searcher: SearcherConfig) -> str:
    """learner.sync_wire_dtype with `auto` resolved to the engines' dtype (bf16 engines get bf16
    on the wire; fp32 engines, the CPU default, get fp32)."""
    if learner.sync_wire_dtype != "auto":
        return learner.sync_wire_dtype
    return "bf16" if searcher.dtype in ("bfloat16", "bf16") else "fp32"
