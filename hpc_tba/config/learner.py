"""Typed configuration of the learner role (`learner=` group)."""
from __future__ import annotations

import dataclasses

from hpc_tba.config.ranges import SEED_NOTE, check_ranges, ranged
from hpc_tba.config.searcher import SearcherConfig


@dataclasses.dataclass
class LearnerConfig:
    """DeepSpeed ZeRO-3 learner."""

    mode: str = "async"
    """async (TBA: train on replay-buffer samples while the searchers keep generating) or sync
    (the on-policy baseline: the searchers generate one batch with the current weights, the
    learner trains on exactly that batch, syncs, and only then do they generate again; needs
    sync_every=1 — the `learner=sync` preset sets both)."""
    total_steps: int = ranged(150, ge=1)
    """Learner updates in the run."""
    prompts_per_step: int = ranged(16, ge=1)
    """Prompts per learner step on each learner rank (each contributes K samples)."""
    micro_batch_size: int = ranged(0, ge=0, note="0: K")
    """Sequences in one forward/backward on one rank; the step's G x K sequences are split into
    micro-batches with gradient accumulation (the update equals the one-batch update). 0: K, one
    prompt group per micro-batch. Learner memory scales with this, never with G."""
    micro_batch_tokens: int = ranged(0, ge=0, note="0: micro-batches of micro_batch_size sequences")
    """Token budget of one forward/backward on one rank, in place of micro_batch_size: the step's
    sequences are bin-packed (longest first; whole prompt groups when each fits) into micro-batches
    that compute at most this many token positions, each packing several sequences to a row (rows
    as long as its longest sequence; each sequence with its own position ids, attending only within
    itself), with the same exact gradient accumulation. Only the rows' tails are padding, so a step
    of RL's ragged responses costs about its real tokens. Every sequence must fit (at least
    searcher.max_model_len). 0: rows of micro_batch_size."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (transformers' gradient checkpointing)."""
    offload_optimizer: bool = False
    """DeepSpeed ZeRO-3: keep optimizer states (and the step) in host memory."""
    offload_params: bool = False
    """DeepSpeed ZeRO-3: keep parameter shards in host memory between uses."""
    logprob_chunk_tokens: int = ranged(1024, ge=1)
    """Token positions per chunk when computing the log-probs of chosen tokens: the fp32
    log-softmax never spans more than this many positions over the whole vocabulary."""
    lr: float = ranged(1e-5, gt=0)
    """Adam learning rate (TBA uses Adam, no gradient clipping). 1e-5 for the embedded default:
    from the banded warm start (52% held-out) 150 steps gained +16 and +18 points at 1e-5 (seed 0,
    twice), +15.5 (seed 1), against +10 at 3e-5 and +6.5 at 1e-4 (issue 17, 2 CPU cores)."""
    adam_beta1: float = ranged(0.9, ge=0, lt=1)
    """Adam's first-moment decay (written to torch's AdamW, not its default)."""
    adam_beta2: float = ranged(0.999, ge=0, lt=1)
    """Adam's second-moment decay."""
    adam_eps: float = ranged(1e-8, gt=0)
    """Adam's denominator term: an entry whose gradient is near it moves by lr * g / (|g| + eps),
    so two layouts whose gradients differ by rounding differ there by up to lr * that change."""
    warmup_steps: int = ranged(10, ge=0)
    """Linear learning-rate warm-up steps."""
    grad_clip: float = ranged(0.0, ge=0, note="0: no clipping")
    """Gradient-norm clip; 0 disables it (the TBA authors use none; always written to DeepSpeed,
    whose own default would clip at 1.0)."""
    sync_every: int = ranged(2, ge=1)
    """k: broadcast weights to the searchers every k learner steps (GSM8K: 2)."""
    sync_bucket_mb: float = ranged(64.0, gt=0)
    """Size of one weight-sync bucket in MiB."""
    sync_wire_dtype: str = "auto"
    """dtype of weights on the wire: auto (the engines' dtype, searcher.dtype), fp32, or bf16
    (half the bytes; what bf16 engines on GPUs run in anyway)."""
    sync_versions_held: int = ranged(2, ge=1, note="host copies of a version that out-of-process engines read")
    """Host copies of recent versions learner rank 0 keeps for out-of-process engines' feeds (each
    engine takes the newest when it is free; the learner never waits for one). >= 1; each is a
    whole version in host memory on learner rank 0's node (the planner counts them)."""
    eval_every: int = ranged(50, ge=0, note="0: only before and after")
    """Held-out evaluation every this many steps (0: only before and after)."""
    log_every: int = ranged(1, ge=1)
    """TensorBoard scalars every this many steps."""
    zero_stage: int = ranged(3, ge=0, le=3)
    """DeepSpeed ZeRO stage (3 shards parameters, gradients and optimizer states)."""
    param_persistence_threshold: int = ranged(100_000, ge=0, note="0: shard every parameter")
    """ZeRO-3: parameters of at most this many elements stay whole on every rank instead of being
    gathered at each use (DeepSpeed's 1e5: norms and biases of a real model); the embedded tiny
    model's yaml sets 0, so every parameter is sharded and CPU runs exercise a 70B run's gathers."""
    dtype: str = "fp32"
    """Training dtype: fp32 or bf16."""
    seed: int = ranged(0, ge=0, note=SEED_NOTE)
    """Seed of sampling from the buffer and of torch on the learner."""
    sync_check: bool = False
    """Debug: after every sync, compare the engines' log-probs on a probe with the learner's."""
    checkpoint_every: int = ranged(0, ge=0, note="0: only on preemption signals and at the end")
    """Checkpoint every this many steps (0: only on preemption signals and at the end)."""
    checkpoint_interval_s: float = ranged(0.0, ge=0, note="0: off")
    """Also checkpoint when this many seconds passed since the last one (0: off)."""
    keep_last: int = ranged(2, ge=1)
    """Complete checkpoints kept (older ones are deleted after a new one is in place)."""
    max_nonfinite_steps: int = ranged(5, ge=0, note="0: stop at the first")
    """Consecutive NaN/inf losses (each skipped) after which the run stops with an error."""
    export_final: bool = True
    """Write the final policy as a Hugging Face directory `<run_dir>/final_model`."""
    sequence_parallel_size: int = ranged(1, ge=1)
    """Ulysses sequence parallelism: SP consecutive learner ranks split each sequence's positions
    (attention by all-to-all, hpc_tba/roles/parallel.py); must divide cluster.num_learners and
    the model's attention and key/value heads. Activation memory per rank ~1/SP."""
    tensor_parallel_size: int = ranged(1, ge=1)
    """DeepSpeed AutoTP inside a node (hpc_tba/roles/tensor_parallel.py): TP consecutive learner
    ranks split every attention and MLP projection (column-parallel q/k/v/gate/up, row-parallel
    o/down); embeddings, norms and the output head stay replicated. Must divide
    cluster.num_learners, the GPUs per node and the model's attention and key/value heads; not
    with sequence_parallel_size > 1. Split layers' parameters and activations per rank ~1/TP."""

    def __post_init__(self) -> None:
        check_ranges(self, "learner")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"learner.mode={self.mode!r} must be async or sync")
        if self.mode == "sync" and self.sync_every != 1:
            raise ValueError(f"learner.mode=sync trains only on samples of the current weights, so "
                             f"it syncs after every step: set learner.sync_every=1 (got "
                             f"{self.sync_every}), or use the preset learner=sync")
        if self.sync_wire_dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(f"learner.sync_wire_dtype={self.sync_wire_dtype!r} must be auto, fp32 or bf16")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"learner.dtype={self.dtype!r} must be fp32 or bf16")
        if self.tensor_parallel_size > 1 and self.sequence_parallel_size > 1:
            raise ValueError(f"learner.tensor_parallel_size={self.tensor_parallel_size} with "
                             f"learner.sequence_parallel_size={self.sequence_parallel_size}: tensor "
                             "and sequence parallelism do not combine in one DeepSpeed engine (AutoTP "
                             "replaces the engine's process groups); choose one")
        if self.micro_batch_tokens and self.sequence_parallel_size > 1:
            raise ValueError(f"learner.micro_batch_tokens={self.micro_batch_tokens} with "
                             f"learner.sequence_parallel_size={self.sequence_parallel_size}: packed "
                             "micro-batches under sequence parallelism are not built yet (the SP split "
                             "numbers positions 0..L-1 across the whole row); use one or the other")
        if self.tensor_parallel_size > 1 and self.zero_stage != 3:
            raise ValueError(f"learner.tensor_parallel_size={self.tensor_parallel_size} needs "
                             f"learner.zero_stage=3 (got {self.zero_stage}): the learner's AutoTP path "
                             "(shards gathered for sync and export) is built and tested under ZeRO-3")


def resolve_wire_dtype(learner: LearnerConfig, searcher: SearcherConfig) -> str:
    """learner.sync_wire_dtype with `auto` resolved to the engines' dtype (bf16 engines get bf16
    on the wire; fp32 engines, the CPU default, get fp32)."""
    if learner.sync_wire_dtype != "auto":
        return learner.sync_wire_dtype
    return "bf16" if searcher.dtype in ("bfloat16", "bf16") else "fp32"
