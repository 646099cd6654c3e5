"""A discrete-event scheduling simulator: synchronous on-policy RL vs TBA's asynchronous loop.

Why: users ask how much faster asynchrony is on *their* cluster and where the time goes, before
they queue a 70B job. This module answers from per-role costs (stated, or measured by a CPU run)
with nothing but Python and numpy, so it imports without torch, MPI or a GPU.

Two schedules over the same hardware and costs:

- ``sync``: every step the generation engines produce one batch (B prompts x S samples) with the
  current weights, split evenly over the engines; then the learner trains on it; then the weights
  are synced. Generation and training never overlap; every trained sample has staleness 0.
- ``async`` (TBA): each searcher loops over rounds of ``prompts_per_round`` prompts; between rounds
  it applies the newest published weights if there are any (a stall of ``apply_s``). The learner
  takes a step whenever the buffer holds ``warm_start_samples`` (and, if ``replay_ratio`` > 0, it
  has not consumed more prompts than that ratio allows); every k steps it spends ``sync_s`` on the
  weight sync and publishes the new version at its end. Each batch slot takes, with probability m,
  a prompt refreshed since the latest sync (falling back to the sync window before), otherwise a
  uniform draw over every group generated so far. Staleness = learner version at the step - the
  policy version that generated the sample.

Roles are accounted in four states (generating, training, syncing, waiting) over the wall-clock
time to N updates (the end of step N and of the sync that follows it: the learner always syncs
after its last step, as `roles/learner.py` does), so the four fractions sum to 1 per role. The
modelling assumptions are in `ASSUMPTIONS` and printed beside every result by `tools/simulate.py`.
"""
from __future__ import annotations

import ast
import dataclasses
import heapq
import inspect
import json
import math
from pathlib import Path

import numpy as np

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


@dataclasses.dataclass
class SimResult:
    """What one simulated run reports."""

    mode: str
    wall_s: float
    steps: int
    samples_generated: int
    samples_trained: int
    utilisation: dict[str, dict[str, float]]
    staleness: np.ndarray  # [steps * batch_prompts] staleness of each trained prompt group
    recent: np.ndarray  # [steps * batch_prompts] whether the group filled a recency slot

    @property
    def gen_samples_per_s(self) -> float:
        return self.samples_generated / self.wall_s

    @property
    def trained_samples_per_s(self) -> float:
        return self.samples_trained / self.wall_s

    def staleness_stats(self) -> dict[str, float]:
        s = self.staleness
        return {"mean": float(s.mean()), "p50": float(np.percentile(s, 50)),
                "p90": float(np.percentile(s, 90)), "max": int(s.max()),
                "recent_frac": float(self.recent.mean()),
                "max_recent": int(s[self.recent].max()) if self.recent.any() else 0}

    def staleness_hist(self) -> list[int]:
        """Count of trained samples per staleness 0, 1, ..., max (each group holds K samples)."""
        return np.bincount(self.staleness.astype(np.int64)).tolist()

    def summary(self, k: int) -> dict:
        hist = [c * k for c in self.staleness_hist()]
        return {"mode": self.mode, "wall_s": self.wall_s, "steps": self.steps,
                "s_per_step": self.wall_s / self.steps,
                "gen_samples_per_s": self.gen_samples_per_s,
                "trained_samples_per_s": self.trained_samples_per_s,
                "utilisation": self.utilisation, "staleness": self.staleness_stats(),
                "staleness_hist": hist}


def _draw(rng: np.random.Generator, mean: float, cv: float) -> float:
    if cv <= 0 or mean <= 0:
        return mean
    shape = 1.0 / (cv * cv)
    return float(rng.gamma(shape, mean / shape))


def _fractions(busy: dict[str, float], wall: float) -> dict[str, float]:
    out = {s: (busy.get(s, 0.0) / wall if wall > 0 else 0.0) for s in STATES if s != "waiting"}
    out["waiting"] = max(0.0, 1.0 - sum(out.values()))
    return out


# --------------------------------------------------------------------------- sync mode
def simulate_sync(cfg: SimConfig) -> SimResult:
    """Generate a batch on every engine, train on it, sync; repeat N times."""
    rng = np.random.default_rng(cfg.seed)
    extra = cfg.num_learners // cfg.engine_tp if cfg.sync_colocated else 0
    engines = cfg.num_searchers + extra
    share = cfg.batch_prompts * cfg.prompt_gen_s / engines  # seconds of work per engine
    gen_slow = cfg.slowdown(cfg.num_searchers + (cfg.num_learners if extra else 0))
    train_slow = cfg.slowdown(cfg.num_learners)
    t = 0.0
    searcher = {"generating": 0.0, "syncing": 0.0}
    learner = {"generating": 0.0, "training": 0.0, "syncing": 0.0}
    for _ in range(cfg.steps):
        per_engine = [_draw(rng, share, cfg.gen_cv) * gen_slow for _ in range(engines)]
        gen = max(per_engine)
        searcher["generating"] += sum(per_engine[:cfg.num_searchers]) / cfg.num_searchers
        if extra:
            learner["generating"] += sum(per_engine[cfg.num_searchers:]) / extra
        train = _draw(rng, cfg.step_cost_s, cfg.learner_cv) * train_slow
        learner["training"] += train
        learner["syncing"] += cfg.sync_cost_s
        searcher["syncing"] += cfg.sync_cost_s
        t += gen + train + cfg.sync_cost_s
    n = cfg.steps * cfg.batch_prompts
    return SimResult("sync", t, cfg.steps, n * cfg.samples_per_prompt, n * cfg.k,
                     {"learner": _fractions(learner, t), "searcher": _fractions(searcher, t)},
                     np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool))


# --------------------------------------------------------------------------- async mode
class _Buffer:
    """Prompt groups in arrival order: policy version per group and the sync-window marks."""

    def __init__(self, rng: np.random.Generator, m: float) -> None:
        self.rng, self.m = rng, m
        self.version = np.zeros(1024, dtype=np.int64)
        self.n = 0
        self.marks = [0, 0]  # first group of the previous and of the current sync window
        self.recent_flags: list[np.ndarray] = []  # per step: which slots were recency slots

    def add(self, version: int, n: int) -> None:
        if self.n + n > len(self.version):
            self.version = np.concatenate([self.version, np.zeros(len(self.version) + n, np.int64)])
        self.version[self.n:self.n + n] = version
        self.n += n

    def mark_sync(self) -> None:
        self.marks = [self.marks[1], self.n]

    def sample(self, n: int) -> np.ndarray:
        """Policy versions of n prompt groups: each slot wants a recent group with probability m;
        as in the real sampler, recent groups are distinct, so a window with fewer groups than
        wanted leaves the other slots to the uniform draw over everything generated."""
        prev, cur = self.marks
        lo, hi = (cur, self.n) if self.n > cur else (prev, cur)
        want = int((self.rng.random(n) < self.m).sum())
        n_recent = min(want, hi - lo)
        recent = lo + self.rng.choice(hi - lo, n_recent, replace=False) if n_recent else []
        rest = self.rng.integers(0, self.n, n - n_recent)
        self.recent_flags.append(np.arange(n) < n_recent)
        return self.version[np.concatenate([np.asarray(recent, dtype=np.int64), rest])]


def simulate_async(cfg: SimConfig) -> SimResult:
    """TBA: searchers generate continuously; the learner trains from the buffer; sync every k."""
    rng = np.random.default_rng(cfg.seed)
    buf = _Buffer(np.random.default_rng(cfg.seed + 1), cfg.recency_m)
    slow = cfg.slowdown(cfg.num_searchers + cfg.num_learners)
    round_s = cfg.prompts_per_round * cfg.prompt_gen_s
    events: list[tuple[float, int, str, int]] = []
    seq = 0

    def push(t: float, kind: str, who: int = 0) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, who))
        seq += 1

    s_version = [0] * cfg.num_searchers
    s_busy: list[list[tuple[str, float, float]]] = [[] for _ in range(cfg.num_searchers)]
    for s in range(cfg.num_searchers):
        d = _draw(rng, round_s, cfg.gen_cv) * slow
        s_busy[s].append(("generating", 0.0, d))
        push(d, "round", s)
    version = published = 0  # learner steps done; version the searchers may pick up
    learner = {"training": 0.0, "syncing": 0.0}
    learner_idle, generated, stale, end = True, 0, [], None

    def try_step(t: float) -> None:
        nonlocal learner_idle
        ready = generated * cfg.samples_per_prompt >= cfg.warm_start_samples and generated > 0
        if cfg.replay_ratio > 0:
            ready = ready and (version + 1) * cfg.batch_prompts <= cfg.replay_ratio * generated
        if not ready:
            learner_idle = True
            return
        learner_idle = False
        stale.append(version - buf.sample(cfg.batch_prompts))
        d = _draw(rng, cfg.step_cost_s, cfg.learner_cv) * slow
        learner["training"] += d
        push(t + d, "step")

    while end is None:
        t, _, kind, who = heapq.heappop(events)
        if kind == "round":
            buf.add(s_version[who], cfg.prompts_per_round)
            generated += cfg.prompts_per_round
            start = t
            if published > s_version[who]:
                s_version[who] = published
                start = t + cfg.apply_cost_s
                s_busy[who].append(("syncing", t, start))
            d = _draw(rng, round_s, cfg.gen_cv) * slow
            s_busy[who].append(("generating", start, start + d))
            push(start + d, "round", who)
            if learner_idle:
                try_step(t)
        elif kind == "step":
            version += 1
            if version % cfg.sync_every == 0 or version == cfg.steps:  # the real learner syncs last
                learner["syncing"] += cfg.sync_cost_s
                push(t + cfg.sync_cost_s, "sync")
            else:
                try_step(t)
        else:  # sync done: the new weights are published and open a new recency window
            published = version
            buf.mark_sync()
            if version == cfg.steps:
                end = t
            else:
                try_step(t)
    searcher = {"generating": 0.0, "syncing": 0.0}
    for intervals in s_busy:
        for state, a, b in intervals:
            searcher[state] += max(0.0, min(b, end) - a) / cfg.num_searchers
    made = sum(1 for intervals in s_busy for st, a, b in intervals if st == "generating" and b <= end)
    return SimResult("async", end, cfg.steps, made * cfg.prompts_per_round * cfg.samples_per_prompt,
                     cfg.steps * cfg.batch_prompts * cfg.k,
                     {"learner": _fractions(learner, end), "searcher": _fractions(searcher, end)},
                     np.concatenate(stale), np.concatenate(buf.recent_flags))


def simulate(cfg: SimConfig, mode: str) -> SimResult:
    if mode == "sync":
        return simulate_sync(cfg)
    if mode == "async":
        return simulate_async(cfg)
    raise ValueError(f"mode={mode!r} must be sync or async")


def compare(cfg: SimConfig) -> dict:
    """Both schedules on the same costs; speed-up = sync wall time / async wall time."""
    s, a = simulate_sync(cfg), simulate_async(cfg)
    return {"sync": s, "async": a, "speedup": s.wall_s / a.wall_s}


def sweep_searchers(cfg: SimConfig, counts: list[int]) -> list[dict]:
    """Speed-up and both wall times for each number of searchers (other costs fixed), and the
    speed-up when the async learner may not train on more prompts than were generated
    (replay_ratio = 1): with few searchers TBA's learner otherwise runs on reused samples."""
    out = []
    for n in counts:
        c = cfg.replace(num_searchers=n)
        r = compare(c)
        capped = simulate_async(c.replace(replay_ratio=1.0))
        out.append({"num_searchers": n, "sync_s": r["sync"].wall_s, "async_s": r["async"].wall_s,
                    "speedup": r["speedup"], "speedup_replay1": r["sync"].wall_s / capped.wall_s})
    return out


def costs(cfg: SimConfig) -> dict[str, float]:
    """The derived per-role costs the simulation runs on (seconds)."""
    return {"learner_step_s": cfg.step_cost_s, "sync_s": cfg.sync_cost_s, "apply_s": cfg.apply_cost_s,
            "prompt_gen_s": cfg.prompt_gen_s,
            "async_round_s": cfg.prompts_per_round * cfg.prompt_gen_s,
            "sync_gen_phase_s": cfg.batch_prompts * cfg.prompt_gen_s / cfg.num_searchers}


# --------------------------------------------------------------------------- presets
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


# --------------------------------------------------------------------------- calibration
CALIBRATION_KEYS = {
    "gen_samples_per_s": "samples per second one searcher generates (required)",
    "learner_step_s": "seconds per learner step, excluding syncs (required)",
    "sync_s": "seconds the learner spends per weight sync (required)",
    "apply_s": "seconds a searcher stalls to load new weights (default 0)",
    "samples_per_prompt": "S (required)",
    "k": "K (required)",
    "prompts_per_step": "prompts per learner step per learner rank (required)",
    "prompts_per_round": "prompts per searcher round (default 1)",
    "num_searchers": "searchers (required)",
    "num_learners": "learner ranks (default 1)",
    "sync_every": "k, steps between syncs (required)",
    "steps": "learner steps of the measured run (required)",
    "warm_start_samples": "samples before the first async step (default 0)",
    "recency_m": "m (default 0.95)",
    "sync_mode / async_mode": "optional dicts of the same keys measured in that mode (override)",
    "measured_speedup": "optional: the measured sync / async time ratio, to state the error",
}


def calibrated_config(measured: dict, mode: str) -> SimConfig:
    """A SimConfig whose costs are the measured per-role costs (one 'token' = one sample)."""
    data = {**{k: v for k, v in measured.items() if not isinstance(v, dict)},
            **measured.get(f"{mode}_mode", {})}
    data.pop("measured_speedup", None)
    missing = [k for k in ("gen_samples_per_s", "learner_step_s", "sync_s", "samples_per_prompt", "k",
                           "prompts_per_step", "num_searchers", "sync_every", "steps") if k not in data]
    if missing:
        raise ValueError(f"calibration JSON lacks: {', '.join(missing)}")
    fields = {"tokens_per_sample": 1.0, "prompt_tokens": 0.0,
              "apply_s": 0.0, "warm_start_samples": 0, "gen_cv": 0.0, "learner_cv": 0.0, **data}
    return with_fields(SimConfig(), fields)


def calibrate(measured: dict) -> dict:
    """Predict the sync / async ratio from measured per-role costs; compare with the measured one."""
    s = simulate_sync(calibrated_config(measured, "sync"))
    a = simulate_async(calibrated_config(measured, "async"))
    out = {"sync_wall_s": s.wall_s, "async_wall_s": a.wall_s, "predicted_speedup": s.wall_s / a.wall_s,
           "sync": s.summary(int(measured["k"])), "async": a.summary(int(measured["k"]))}
    if "measured_speedup" in measured:
        m = float(measured["measured_speedup"])
        out["measured_speedup"] = m
        out["relative_error"] = (out["predicted_speedup"] - m) / m
    return out
