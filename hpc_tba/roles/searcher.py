"""The searcher role: a generation engine (engine.base.Engine; vLLM in runs) that never stops
generating.

Loop (`run`): apply the newest weights that arrived (`searcher.update=between_rounds`: between
rounds only, so one sample never mixes two versions; `in_flight`: also between decode steps of a
round, every token stamped with the version that produced it, see below), evaluate on the
held-out slice when the learner asked for it, generate S
samples for each of the next prompts of this searcher's slice, score them, and send each prompt's
samples, stamped with the engine's version, to the buffer shard that owns the prompt. Sends are
non-blocking and overlap the next round. On STOP it finishes the round, flushes its sends and
tells every learner how many trajectories it sent there (DONE), so nothing is left in flight.

With `learner.mode=sync` (`on_policy_quota` set) the searcher generates one batch per weight
version, its share of each learner shard's G prompts, and then waits for the next version.

Prompt cursors (the shuffled order of the slice still to visit, and the RNG) are written to
`<run_dir>/searchers/searcher<i>.json` at the start of every round, before the round's prompts
are picked; a resumed run continues from there, so no prompt of a pass is skipped across a
restart (the prompts of a round cut short are generated again).

Prompts longer than `max_model_len - max_new_tokens` are skipped before generation and counted
(`searcher/skipped_long_prompts`): vLLM would reject them, and the engine is never rebuilt for it.

In-flight updates and what a mixed-version response means for each loss (docs/SEARCHERS.md):
every token carries the version that produced it and its behaviour log-prob is exact under that
version (the engine re-prefills running sequences under the new weights, engine/step_loop.py),
so a mixed response is an exact sample of a known mixture policy mu(y_t | prefix) = pi_v(t).
- TB uses no behaviour log-prob at all (valid for any full-support behaviour): unaffected.
- TOPR's Delta = S - sum_t log mu(y_t | prefix) is exact, so its truncated weights are right.
- GRPO's per-token ratio pi_theta / mu is taken against the exact per-token mu: correct.
- RLOO (and SFT/DPO) use no importance weights: a mixed response is off-policy by at most its
  oldest token's lag, like any asynchronous sample; cap it with max_version_span if that matters.
A batch's `policy_version` is the oldest version of its tokens, so the buffer's staleness is
never understated. `searcher.max_version_span` caps the versions one response may span (0 keeps
all; responses over the cap are dropped and counted in `searcher/dropped_version_span`).

Continuous generation (`searcher.generation=continuous`, or `auto` with `update=in_flight` and
an asynchronous learner): no rounds; the engine keeps `prompts_per_round` groups running and
each is sent as soon as it finishes (roles/continuous.py, this class's base). `generation=auto`
with between-rounds updates, or with `learner.mode=sync`, generates in rounds.

Each round logs where the searcher's time went (`util/generate`, `util/apply`, `util/eval`,
`util/wait`; roles.logging.Timers).

Engine faults: if the engine raises (a crashed worker, an out-of-memory, a CUDA error), the
searcher discards it, builds a new one from `engine_factory` (an out-of-process one joins a fresh
engine group), loads a newer version waiting in its receiver, else the version it had applied if
the staging still holds it whole, else waits for the next one sent, and carries on; that round's samples are dropped
(nothing had been sent). The learner never notices beyond a gap in this searcher's traffic.
After `max_engine_restarts` consecutive failures the searcher gives up and the rank fails.
Fault injection for tests: HPC_TBA_FAULT_ENGINE_ROUNDS="3,7" raises inside rounds 3 and 7.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np

from hpc_tba.comm.messages import Done, EvalReport, ProbeReport, Stop, TrajectoryBatch
from hpc_tba.comm.transport import Transport
from hpc_tba.comm.weight_sync import StagedWeights, WeightReceiver
from hpc_tba.config import SearcherConfig
from hpc_tba.config.topology import Topology
from hpc_tba.engine.base import Engine
from hpc_tba.roles.continuous import ContinuousGeneration, Window
from hpc_tba.roles.logging import RunLogger, Timers
from hpc_tba.tasks import Task


class Searcher(ContinuousGeneration):
    def __init__(self, *, cfg: SearcherConfig, task: Task, engine: Engine,
                 receiver: WeightReceiver | None, transport: Transport, topo: Topology,
                 index: int, run_dir: str, engine_factory: Callable[[], Engine] | None = None,
                 max_engine_restarts: int = 5, on_policy_quota: dict[int, int] | None = None):
        self.cfg, self.task, self.engine, self.receiver = cfg, task, engine, receiver
        self.engine_factory = engine_factory
        if hasattr(receiver, "serve_engine"):  # out of process: the workers receive (issue 24)
            receiver.serve_engine(engine)
        self.max_engine_restarts = max_engine_restarts
        self.restarts, self._failures_in_row = 0, 0
        self._await_weights = False  # a rebuilt engine with no staged copy to reload: wait
        self.skipped_long = 0
        self._pending_evals: list[int] = []  # versions to evaluate, taken with their weights
        self.dropped_span = 0
        self._round_s = 1.0  # the last round's duration (how long a skipping searcher waits)
        self._skipped_logged = 0
        self._faults = {int(x) for x in os.environ.get("HPC_TBA_FAULT_ENGINE_ROUNDS", "").split(",") if x}
        self.transport, self.topo, self.index = transport, topo, index
        train = task.prompts("train")
        self.prompts = [train[i] for i in topo.prompts_of_searcher(index, len(train))]
        if not self.prompts:
            raise ValueError(f"searcher {index} has no prompts: {len(train)} train prompts for "
                             f"{topo.num_searchers} searchers")
        self.test = task.prompts("test")[index::topo.num_searchers]
        self.tokens = engine.tokenize([p.text for p in self.prompts])
        self.rng = np.random.default_rng(cfg.seed + index)
        # Prompt cursors: per pool, the slice positions still to visit this pass. One pool (the
        # whole slice) in async mode; one per learner shard when generating on-policy quotas.
        self.quota = on_policy_quota
        shards = sorted(on_policy_quota) if on_policy_quota else [None]
        self.pools = {s: [i for i, p in enumerate(self.prompts)
                          if s is None or topo.shard_of_prompt(p.id) == s] for s in shards}
        self.orders: dict[int | None, list[int]] = {s: [] for s in shards}
        self._generated_version: int | None = None  # mode=sync: version of the last batch
        self.state_path = os.path.join(run_dir, "searchers", f"searcher{index}.json")
        self.timers = Timers()
        self.rounds = 0
        self.sent = 0
        self.evaluated: dict[int, float] = {}
        self.probe: tuple[list[int], list[int]] | None = None  # set when the run checks syncs
        self.resumed = False  # a resumed run: the starting weights are not the run's version 0
        self.log = RunLogger(run_dir, f"searcher{index}")
        self.continuous = cfg.generation == "continuous" or (
            cfg.generation == "auto" and cfg.update == "in_flight" and on_policy_quota is None)
        if cfg.generation == "continuous" and on_policy_quota is not None:
            raise ValueError("learner.mode=sync generates one batch per weight version: it needs "
                             "searcher.generation=rounds, not continuous")
        self._stopping = False  # STOP has arrived (continuous: drain, then finish)
        self._running: list[int] = []  # continuous: slice indices admitted, not yet finished
        self._window = Window()  # continuous: the groups finished since the last log line
        self._saved_at = 0.0
        self._admitted, self._t_apply = 0, 0.0
        self.held_back = 0  # continuous: admissions refused by back-pressure (max_sends_in_flight)

    def run(self) -> None:
        self.transport.barrier()  # every rank has built its role: all clocks start together
        self.timers = Timers()
        if self.resumed:
            self.load_cursors()
            self._generated_version = self.engine.version  # mode=sync: wait for the run's weights
        else:
            with self.timers("eval"):
                self.evaluate(self.engine.version)
        while not self.stop_requested():
            try:
                self.apply_weights()
                if self.quota is not None and self._generated_version == self.engine.version:
                    with self.timers("wait"):  # this version's batch is done: wait for the next
                        if self.receiver is not None:
                            self.receiver.wait_for(self.engine.version + 1, timeout=0.05)
                    continue
                if self.continuous:
                    self.generate_continuous()
                else:
                    self.generate_round()
                    self._failures_in_row = 0
            except Exception as e:  # the engine failed: replace it, keep the searcher alive
                self.restart_engine(e)
        self.finish()

    def restart_engine(self, error: Exception) -> None:
        self._failures_in_row += 1
        if self.engine_factory is None or self._failures_in_row > self.max_engine_restarts:
            raise error
        print(f"hpc-tba: searcher {self.index}: engine failed ({type(error).__name__}: {error}); "
              f"restarting it (restart {self.restarts + 1})", file=sys.stderr, flush=True)
        t0 = time.time()
        try:  # vLLM's shutdown frees what the engine held (VLLMEngine.close), before the rebuild
            self.engine.close()
        except Exception as e:  # noqa: BLE001 - a broken engine may fail its shutdown; say so
            print(f"hpc-tba: searcher {self.index}: closing the failed engine raised "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        version = self.engine.version
        self.engine = self.engine_factory()
        if hasattr(self.receiver, "serve_engine"):  # a rebuilt engine joins a fresh group
            self.receiver.serve_engine(self.engine)
        if self.receiver is not None and version > 0:
            if self.receiver.ready():  # a newer version is waiting: applied (and logged) as usual
                self._load_newest()
            else:  # the version applied last, if the staging still holds it whole
                with self.receiver.reading():
                    staged = self.receiver.current()
                    if staged is not None and staged.version >= version:
                        self.engine.load_weights(staged.tensors, staged.version)
            self._await_weights = self.engine.version < version  # none staged: wait for the next
        self.restarts += 1
        self.log.scalars(self.rounds, {"searcher/engine_restarts": self.restarts,
                                       "searcher/engine_restart_s": time.time() - t0,
                                       "searcher/version": self.engine.version})

    def apply_weights(self) -> None:
        if self.receiver is None:
            return
        rx = self.receiver
        if rx.staging == "stream" and self.cfg.update == "between_rounds" and rx.skipped_versions \
                and max(rx.skipped_versions) > self.engine.version and not rx.ready():
            # versions went by during the round (streamed versions cannot wait in memory): wait
            # for the next one, at most a round's time, so the engine does not fall behind for good
            with self.timers("wait"):
                rx.wait_for(max(rx.skipped_versions) + 1, timeout=self._round_s)
        while self._await_weights and not self.receiver.ready():
            with self.timers("wait"):  # a rebuilt engine on the checkpoint's weights: not sampled
                if self.receiver.wait_for(max(self.receiver.received_versions, default=0) + 1, 0.05):
                    break
                # the learners may be done before a rebuilt engine is back: no version will come
                if self.receiver.stopped or self.stop_requested():
                    return
        version = self._load_newest()
        self._await_weights = self._await_weights and version is None
        for v in self._pending_evals:  # evaluated with the newest weights, which are at least v
            with self.timers("eval"), self._busy():
                self.evaluate(v)
        self._pending_evals = []
        if len(rx.skipped_versions) != self._skipped_logged:
            self._skipped_logged = len(rx.skipped_versions)
            self.log.scalars(self.rounds, {"searcher/versions_skipped": self._skipped_logged})

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Stream staging, between-rounds updates: while a round (or an evaluation) runs, versions
        are skipped, not held (the learners never wait for this searcher); one accepted just
        before is loaded first."""
        rx = self.receiver
        if rx is None or rx.staging != "stream" or self.cfg.update == "in_flight":
            yield
            return
        while rx.close_window():
            self._load_newest()
        try:
            yield
        finally:
            rx.open_window()

    def _load_newest(self) -> int | None:
        """Load the newest version the receiver holds, if any (staged or streamed); returns it."""
        t0 = time.time()
        with self.timers("apply"), self.receiver.reading():
            staged, evals = self.receiver.take()
            self._pending_evals = self._pending_evals + evals
            if staged is None:
                return None
            tensors = staged.tensors if isinstance(staged, StagedWeights) else staged.tensors()
            self.engine.load_weights(tensors, staged.version)
        self.log.scalars(self.rounds, {"searcher/version": staged.version,
                                       "searcher/weight_apply_s": time.time() - t0})
        if self.probe is not None:
            logp = self.engine.score(*self.probe, temperature=1.0)
            self.transport.send(0, ProbeReport(staged.version, np.asarray(logp, np.float64)))
        return staged.version

    def generate_round(self) -> None:
        t0 = time.time()
        with self._busy(), self.timers("generate"):
            self._generate_round()
        self._round_s = time.time() - t0

    def _generate_round(self) -> None:
        t0 = time.time()
        self.save_cursors()
        if self.quota is None:
            picks = self._next_prompts(None, self.cfg.prompts_per_round)
        else:
            picks = [i for s, q in sorted(self.quota.items()) for i in self._next_prompts(s, q)]
        version = self.engine.version
        if not picks:  # mode=sync with more searchers than prompts per step: nothing to do
            self._generated_version = version
            return
        if self.rounds + 1 in self._faults:
            self._faults.discard(self.rounds + 1)
            raise RuntimeError(f"injected engine fault in round {self.rounds + 1}")
        fits = [i for i in picks if self.engine.prompt_fits(self.tokens[i])]
        self.skipped_long += len(picks) - len(fits)
        outs = self._sample([self.tokens[i] for i in fits]) if fits else []
        flat_prompts = [self.prompts[i] for i, o in zip(fits, outs) for _ in o]
        texts = [self.engine.decode(s.tokens) for o in outs for s in o]
        rewards, failed = self.task.rewards(flat_prompts, texts) if texts else (np.zeros(0, np.float32), 0)
        gen_s = time.time() - t0
        n_tok = self._send_round(fits, outs, rewards, version)
        self.rounds += 1
        self._generated_version = version
        self.log.scalars(self.rounds, {
            "searcher/skipped_long_prompts": self.skipped_long,
            "searcher/dropped_version_span": self.dropped_span,
            "searcher/updates_in_flight": self.engine.updates_in_flight,
            "searcher/reward_mean": float(rewards.mean()) if rewards.size else 0.0,
            "searcher/reward_failures": failed,
            "searcher/gen_tokens_per_s": n_tok / max(gen_s, 1e-9),
            "searcher/round_s": time.time() - t0, "searcher/version": version,
            "searcher/sends_in_flight": self.transport.progress(), **self.timers.metrics(),
            **(self.task.round_metrics(flat_prompts, texts, rewards) if texts else {})})  # e.g. red-team diversity

    def _sample(self, prompts: list[list[int]]) -> list:
        kw = dict(n=self.cfg.samples_per_prompt, temperature=self.cfg.temperature,
                  max_tokens=self.cfg.max_new_tokens)
        if self.cfg.update == "in_flight" and self.receiver is not None:
            kw.update(weights_ready=self.receiver.ready, apply=self._load_newest)
        return self.engine.sample(prompts, **kw)

    def _send_round(self, picks: list[int], outs: list, rewards: np.ndarray, version: int) -> int:
        """Send each prompt's samples to its shard; returns the tokens sent. In flight, a sample's
        tokens carry their versions and the batch's policy_version is the oldest of them."""
        off, n_tok, cap = 0, 0, self.cfg.max_version_span
        for i, samples in zip(picks, outs):
            rew, off = rewards[off:off + len(samples)], off + len(samples)
            if cap:
                keep = [j for j, s in enumerate(samples)
                        if s.versions is None or len(np.unique(s.versions)) <= cap]
                self.dropped_span += len(samples) - len(keep)
                samples, rew = [samples[j] for j in keep], rew[keep]
            if not samples:
                continue
            versions = None
            if samples[0].versions is not None:
                versions = np.concatenate([s.versions for s in samples])
            batch = TrajectoryBatch(
                prompt_id=self.prompts[i].id, prompt_tokens=np.asarray(self.tokens[i], np.int32),
                response_tokens=np.concatenate([s.tokens for s in samples]),
                lengths=np.array([len(s.tokens) for s in samples], np.int32),
                rewards=rew, logp_behavior=np.concatenate([s.logp for s in samples]),
                policy_version=int(versions.min()) if versions is not None else version,
                searcher_id=self.index, timestamp=time.time(),
                token_versions=None if versions is None or (versions == versions[0]).all() else versions)
            self.transport.send(self.topo.shard_of_prompt(batch.prompt_id), batch)
            self.sent += 1
            n_tok += int(batch.lengths.sum())
        return n_tok

    def _next_prompts(self, pool: int | None, n: int) -> list[int]:
        """The next n prompts of a pool (this searcher's slice, or its part in one learner
        shard), reshuffled at each pass."""
        out, order, members = [], self.orders[pool], self.pools[pool]
        if n and not members:
            raise ValueError(f"searcher {self.index} holds no prompt of learner shard {pool}")
        while len(out) < n:
            if not order:
                order.extend(members[j] for j in self.rng.permutation(len(members)).tolist())
            out.append(int(order.pop()))
        return out

    def save_cursors(self) -> None:
        """Persist the prompt cursors (atomically; called before a round picks its prompts)."""
        # continuous: the groups still running go back on the cursor (popped first, in admission
        # order), so a resumed run generates them again; a group's prompt is never skipped
        running = self._running[::-1]
        state = {"rng": self.rng.bit_generator.state, "rounds": self.rounds,
                 "orders": {str(k): v + running if k is None else v for k, v in self.orders.items()}}
        self._saved_at = time.time()
        os.makedirs(os.path.dirname(self.state_path), exist_ok=True)
        tmp = f"{self.state_path}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, self.state_path)

    def load_cursors(self) -> None:
        """Continue a resumed run's pass over the prompts where the last run left it."""
        if not os.path.exists(self.state_path):
            return
        try:
            with open(self.state_path) as f:
                state = json.load(f)
            orders = {None if k == "None" else int(k): [int(i) for i in v]
                      for k, v in state["orders"].items()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"unreadable searcher state {self.state_path}: {e}") from None
        members = {k: set(v) for k, v in self.pools.items()}
        if set(orders) != set(members) or any(not members[k].issuperset(v) for k, v in orders.items()):
            print(f"hpc-tba: searcher {self.index}: {self.state_path} is from another layout or "
                  "mode; starting a fresh pass over the prompts", file=sys.stderr, flush=True)
            return
        self.rng.bit_generator.state = state["rng"]
        self.orders = orders

    def evaluate(self, version: int) -> None:
        """Greedy pass@1 on this searcher's slice of the test split, reported to learner 0
        (a prompt too long for the engine is skipped, counted, and scores as not correct)."""
        toks = self.engine.tokenize([p.text for p in self.test]) if self.test else []
        fits = [i for i, t in enumerate(toks) if self.engine.prompt_fits(t)]
        self.skipped_long += len(toks) - len(fits)
        correct = 0
        if fits:
            outs = self.engine.greedy([toks[i] for i in fits], max_tokens=self.cfg.max_new_tokens)
            correct = int(self.task.correct([self.test[i] for i in fits],
                                            [self.engine.decode(o) for o in outs]).sum())
        self.evaluated[version] = correct / max(len(self.test), 1)
        self.transport.send(0, EvalReport(version, correct, len(self.test)))

    def stop_requested(self) -> bool:
        self._stopping = self._stopping or bool(self.transport.receive(Stop))
        return self._stopping

    def finish(self) -> None:
        times = self.timers.metrics()
        self.log.scalars(self.rounds, times)
        self.log.write_json(f"summary_searcher{self.index}.json",
                            {"rounds": self.rounds, "restarts": self.restarts, "sent": self.sent,
                             "time": times})
        self.transport.flush()
        for r in self.topo.learner_ranks:
            self.transport.send(r, Done(self.transport.sent_to.get(r, 0)))
        self.transport.flush()
        if self.receiver is not None:
            self.receiver.join()

    def close(self) -> None:
        self.log.close()
        self.engine.close()

