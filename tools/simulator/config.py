"""The simulator's inputs: the per-role costs and layout of one run (`SimConfig`), the states a
role is accounted in, the modelling assumptions, and reading a configuration from JSON."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
from pathlib import Path

STATES = ("generating", "training", "syncing", "waiting")

ASSUMPTIONS = (
    "No contention between roles: each role runs on its own devices at its stated rate "
    "(unless `cores` > 0, which divides the cores evenly among the roles that are busy in a phase).",
    "Generation throughput (tokens/s per engine) does not depend on batch size or concurrency; "
    "it scales linearly with the number of engines; prefill is free.",
    "Every sample has `tokens_per_sample` response tokens (the cap, not a length distribution); "
    "random costs, when cv > 0, are gamma-distributed per round / step around the mean.",
    "A learner step costs the same whatever the staleness of its samples; learner ranks work in "
    "lock-step (weak scaling: each rank takes prompts_per_step prompts at its own tokens/s; "
    "ZeRO-3 communication is folded into that rate).",
    "Weight sync = fixed latency + model bytes / link bandwidth on the learner. In async mode the "
    "searchers receive the weights into a staging copy without pausing and stall only to apply "
    "them between rounds (engine bytes / apply bandwidth); in sync mode the idle engines take part "
    "in the sync and need no separate apply.",
    "Sync mode splits each batch evenly over the engines at sample granularity and waits for the "
    "slowest engine; it syncs after every step (on-policy); the learner GPUs do not generate "
    "unless `sync_colocated`.",
    "Buffer: no eviction; the non-recent branch draws uniformly over all generated prompt groups "
    "(the real buffer draws over prompts, then over a prompt's stored samples; reward priority is "
    "not modelled).",
    "Time to N updates, not to a target accuracy: the value of a stale or reused sample is not "
    "modelled (replay_ratio caps reuse); evaluation and checkpoints are not modelled.",
)


@dataclasses.dataclass
class SimConfig:
    """Costs and layout of one run; every rate is per engine or per learner rank."""

    gen_tokens_per_s: float = 8000.0
    """Generated tokens per second of one generation engine (all its concurrent sequences)."""
    tokens_per_sample: float = 512.0
    """Response tokens per sample (the generation and learner cost of one sample)."""
    prompt_tokens: float = 0.0
    """Prompt tokens per sample; only the learner pays for them (prefill assumed free)."""
    samples_per_prompt: int = 24
    """S: responses generated per prompt."""
    k: int = 20
    """K: responses of one prompt in a learner batch (S - K are generated but not trained on)."""
    prompts_per_step: int = 7
    """Prompts per learner step on each learner rank (batch = num_learners x this x K samples)."""
    prompts_per_round: int = 1
    """Prompts a searcher generates per round in async mode (weights are applied between rounds)."""
    learner_tokens_per_s: float = 15000.0
    """Tokens (prompt + response) one learner rank trains per second, reference forward included."""
    learner_step_s: float | None = None
    """Seconds per learner step; overrides learner_tokens_per_s when set (e.g. measured)."""
    model_params: float = 1.1e9
    """Model size in parameters (weights that a sync moves)."""
    bytes_per_param: float = 2.0
    """Bytes per parameter on the wire (2 for bf16, 4 for fp32)."""
    link_gb_per_s: float = 50.0
    """Effective bandwidth of the weight broadcast, GB/s (gather + broadcast, all buckets)."""
    sync_latency_s: float = 1.0
    """Fixed cost of one sync (ZeRO-3 gathers, bucket set-up, handshake)."""
    sync_s: float | None = None
    """Seconds the learner spends per weight sync; overrides latency + bytes / bandwidth when set."""
    apply_gb_per_s: float = 25.0
    """Bandwidth at which a searcher loads staged weights into its engine, GB/s per GPU."""
    apply_s: float | None = None
    """Seconds a searcher stalls to apply new weights (async); overrides the bandwidth model."""
    engine_tp: int = 1
    """GPUs per generation engine (tensor parallelism); each loads 1/engine_tp of the weights."""
    sync_every: int = 2
    """k: weight sync every k learner steps (async mode; sync mode syncs every step)."""
    recency_m: float = 0.95
    """m: probability that a batch slot takes a prompt refreshed since the latest sync."""
    num_searchers: int = 3
    """Generation engines (searchers)."""
    num_learners: int = 1
    """Learner ranks (ZeRO-3 data parallel)."""
    steps: int = 700
    """N: learner updates to simulate."""
    warm_start_samples: int = 500
    """Samples the buffer must hold (all shards together) before the first async learner step."""
    replay_ratio: float = 0.0
    """Async: max prompts trained per prompt generated; 0 = unlimited (TBA: the learner never waits)."""
    sync_colocated: bool = False
    """Sync mode: the learner GPUs also run engines (num_learners // engine_tp more engines)."""
    gen_cv: float = 0.0
    """Coefficient of variation of a generation round's duration (0 = deterministic)."""
    learner_cv: float = 0.0
    """Coefficient of variation of a learner step's duration (0 = deterministic)."""
    cores: float = 0.0
    """CPU runs: cores shared by all roles (0 = no contention, one device per role)."""
    threads_per_role: float = 1.0
    """CPU runs: busy threads of one role (with `cores`)."""
    seed: int = 0
    """Seed of the random costs and of the batch sampler."""

    def __post_init__(self) -> None:
        positive = ("gen_tokens_per_s", "tokens_per_sample", "samples_per_prompt", "k",
                    "prompts_per_step", "prompts_per_round", "learner_tokens_per_s", "sync_every",
                    "num_searchers", "num_learners", "steps", "engine_tp", "link_gb_per_s",
                    "apply_gb_per_s", "threads_per_role")
        bad = [f for f in positive if not getattr(self, f) > 0]
        if bad:
            raise ValueError(f"these must be > 0: {', '.join(bad)}")
        if not math.isfinite(self.gen_tokens_per_s):
            raise ValueError("gen_tokens_per_s must be finite (use a large number for 'free')")
        if self.k > self.samples_per_prompt:
            raise ValueError(f"K={self.k} cannot exceed S={self.samples_per_prompt}")
        if not 0.0 <= self.recency_m <= 1.0:
            raise ValueError(f"recency_m={self.recency_m} must be in [0, 1]")
        negative = [f for f in ("prompt_tokens", "model_params", "bytes_per_param", "sync_latency_s",
                                "warm_start_samples", "replay_ratio", "gen_cv", "learner_cv", "cores")
                    if getattr(self, f) < 0]
        negative += [f for f in ("learner_step_s", "sync_s", "apply_s")
                     if getattr(self, f) is not None and getattr(self, f) < 0]
        if negative:
            raise ValueError(f"these must be >= 0: {', '.join(negative)}")

    # ------------------------------------------------------------- derived costs (seconds)
    @property
    def batch_prompts(self) -> int:
        """Prompts per learner step over all learner ranks."""
        return self.num_learners * self.prompts_per_step

    @property
    def step_cost_s(self) -> float:
        if self.learner_step_s is not None:
            return self.learner_step_s
        tokens = self.prompts_per_step * self.k * (self.tokens_per_sample + self.prompt_tokens)
        return tokens / self.learner_tokens_per_s

    @property
    def sync_cost_s(self) -> float:
        if self.sync_s is not None:
            return self.sync_s
        return self.sync_latency_s + self.model_params * self.bytes_per_param / (self.link_gb_per_s * 1e9)

    @property
    def apply_cost_s(self) -> float:
        if self.apply_s is not None:
            return self.apply_s
        return self.model_params * self.bytes_per_param / self.engine_tp / (self.apply_gb_per_s * 1e9)

    @property
    def prompt_gen_s(self) -> float:
        """Seconds one engine needs for the S samples of one prompt."""
        return self.samples_per_prompt * self.tokens_per_sample / self.gen_tokens_per_s

    def slowdown(self, busy_roles: int) -> float:
        """CPU contention: how much slower a role runs when `busy_roles` roles share the cores."""
        if self.cores <= 0:
            return 1.0
        return max(1.0, busy_roles * self.threads_per_role / self.cores)

    def replace(self, **changes) -> SimConfig:
        return dataclasses.replace(self, **changes)


def field_docs() -> dict[str, str]:
    """The docstring under each SimConfig field (for CLI help and the docs)."""
    tree = ast.parse(inspect.getsource(SimConfig))
    body, docs = tree.body[0].body, {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def from_json(path: str | Path, base: SimConfig | None = None) -> SimConfig:
    """Override `base` (default: SimConfig()) with the SimConfig fields of a JSON file."""
    data = json.loads(Path(path).read_text())
    return with_fields(base or SimConfig(), data)


def with_fields(base: SimConfig, data: dict) -> SimConfig:
    """`base` with the given fields replaced; `gen_samples_per_s` (a measured rate per searcher)
    is accepted in place of gen_tokens_per_s and converted with tokens_per_sample."""
    data = dict(data)
    if "gen_samples_per_s" in data:
        per_sample = data.get("tokens_per_sample", base.tokens_per_sample)
        data["gen_tokens_per_s"] = float(data.pop("gen_samples_per_s")) * per_sample
    names = {f.name for f in dataclasses.fields(SimConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown SimConfig fields: {', '.join(unknown)}")
    return base.replace(**data)
