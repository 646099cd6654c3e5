"""Typed configuration of the searcher role (`searcher=` group)."""
from __future__ import annotations

import dataclasses

from hpc_tba.config.ranges import SEED_NOTE, check_ranges, ranged


@dataclasses.dataclass
class SearcherConfig:
    """vLLM searcher: generates S samples per prompt and ships them all; the learner takes K."""

    samples_per_prompt: int = ranged(12, ge=1)
    """S: responses generated per prompt (the paper: S = 1.2 K)."""
    k: int = ranged(10, ge=1)
    """K: responses of one prompt in one learner micro-batch (TB's logZ group)."""
    temperature: float = ranged(0.7, gt=0)
    """Sampling temperature; log-probs on both sides come from logits / temperature."""
    prompts_per_round: int = ranged(8, ge=1)
    """Prompts per generation round (generation=continuous: groups kept running at once; metrics
    are logged once per this many finished groups)."""
    update: str = "between_rounds"
    """When an engine applies a new weight version: between_rounds (a response never mixes
    versions) or in_flight (running requests continue on the new weights between decode steps;
    every response token carries the version that produced it)."""
    generation: str = "auto"
    """rounds (an engine admits a round's prompts and drains them before the next), continuous
    (the engine keeps prompts_per_round groups running and admits the next prompt whenever one
    finishes; each group is sent as soon as it is complete; needs update=in_flight and
    learner.mode=async), or auto: continuous with update=in_flight and an asynchronous learner,
    rounds otherwise (between-rounds updates; learner.mode=sync, one batch per version)."""
    max_sends_in_flight: int = ranged(64, ge=0, note="0: no bound")
    """continuous: no new prompt is admitted while this many of the searcher's trajectory sends
    are still in flight (not yet taken by the buffer's rank: back-pressure); 0: no bound."""
    staging: str = "auto"
    """Where a received weight version waits for the engine: device (one version in the engine's
    dtype on its GPU), host (pinned host memory), stream (at most three buckets: bucket by bucket straight
    into the engine, in or out of process; a version arriving mid-round with between_rounds
    updates is skipped and counted), or auto (stream, for every update mode: no process on a
    searcher node holds a whole version; out of process the engine's workers stream whatever this
    says, docs/SEARCHERS.md)."""
    max_version_span: int = ranged(0, ge=0, note="0: no cap")
    """in_flight: most weight versions one response may carry; a response whose tokens come from
    more versions is dropped (counted in searcher/dropped_version_span). 0: no cap (keep all:
    the behaviour log-prob of every token is exact for the version stamped on it)."""
    stop: list[str] = dataclasses.field(default_factory=list)
    """Stop strings ending a response besides the tokenizer's EOS (the stop string is kept)."""
    enforce_eager: bool | None = None
    """vLLM without CUDA graphs; None: eager on CPU, CUDA graphs on GPU."""
    max_new_tokens: int = ranged(8, ge=1)
    """Longest response."""
    max_model_len: int = ranged(64, ge=2)
    """vLLM max sequence length."""
    kv_cache_mb: int = ranged(64, ge=1)
    """KV-cache size per engine in MiB (vLLM would otherwise reserve most of RAM on CPU)."""
    gpu_memory_utilization: float = ranged(0.85, gt=0, le=1)
    """GPU engines: fraction of device memory vLLM may use."""
    tensor_parallel_size: int = ranged(1, ge=1)
    """GPU engines: GPUs one engine spans."""
    engine_process: bool = False
    """Run the vLLM engine in child processes (vLLM V1 multiprocessing) instead of inside the
    searcher's process; its workers receive the weight sync themselves, on the engine's own group
    with learner rank 0 (docs/SEARCHERS.md). Always on when
    tensor_parallel_size > 1 (vLLM's tensor-parallel workers are processes of their own)."""
    dtype: str = "float32"
    """Engine dtype (float32 on CPU so the engine's log-probs match the learner's)."""
    seed: int = ranged(0, ge=0, note=SEED_NOTE)
    """Base seed; searcher i uses seed + i."""

    def __post_init__(self) -> None:
        check_ranges(self, "searcher")
        if self.max_model_len <= self.max_new_tokens:
            raise ValueError(f"searcher.max_model_len={self.max_model_len} must exceed "
                             f"searcher.max_new_tokens={self.max_new_tokens} (the prompt needs room)")
        if self.update not in ("between_rounds", "in_flight"):
            raise ValueError(f"searcher.update={self.update!r} must be between_rounds or in_flight")
        if self.generation not in ("auto", "rounds", "continuous"):
            raise ValueError(f"searcher.generation={self.generation!r} must be auto, rounds or continuous")
        if self.generation == "continuous" and self.update != "in_flight":
            raise ValueError("searcher.generation=continuous applies new weights between decode steps: "
                             f"it needs searcher.update=in_flight, not {self.update!r}")
        if self.staging not in ("auto", "device", "host", "stream"):
            raise ValueError(f"searcher.staging={self.staging!r} must be auto, device, host or stream")
        if self.tensor_parallel_size > 1:
            self.engine_process = True  # tensor-parallel workers always live in other processes
