"""The two schedules over the same costs: synchronous on-policy RL and TBA's asynchronous loop
(the model is described in the package docstring, `simulator/__init__.py`)."""
from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from simulator.config import STATES, SimConfig


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
