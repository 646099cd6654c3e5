"""Continuous generation for the searcher role (`searcher.generation=continuous`, with
`update=in_flight`): no rounds.

The engine keeps `prompts_per_round` groups (the S samples of one prompt) running
(`Engine.generate`); when a group finishes it is scored and sent at once and the next prompt is
admitted in the same step, so the batch never empties while prompts are admissible. New weights
are applied between decode steps (and the evaluations that came with them run then, on the idle
engine). No prompt is admitted while `searcher.max_sends_in_flight` sends are still in flight
(back-pressure from the buffer's rank), nor after STOP: the running groups are drained and sent,
then the searcher's loop sends DONE. The cursor file also holds the groups still running, so a
resumed run (or a rebuilt engine) generates them again. Metrics are logged once per
`prompts_per_round` finished groups (one "round").

`ContinuousGeneration` is a part of `roles.searcher.Searcher` (its base class): the methods here
use the searcher's state (engine, receiver, transport, cursors, timers, logger) and its helpers
(`_next_prompts`, `_send_round`, `_load_newest`, `evaluate`, `save_cursors`, `stop_requested`).
Where the searcher's time goes, in continuous mode: `util/generate` (engine steps, scoring and
sending), `util/apply` (weights loaded between two steps; the engine is paused meanwhile),
`util/eval`, `util/wait` (back-pressure with nothing running).
"""
from __future__ import annotations

import time

import numpy as np


class ContinuousGeneration:
    """The continuous step loop of a Searcher (module docstring)."""

    def generate_continuous(self) -> None:
        """Continuous generation: the engine keeps prompts_per_round groups running and each is
        scored and sent as soon as it finishes. Returns once nothing runs and nothing is to be
        admitted (STOP: after draining what runs; back-pressure: after a short wait); an engine
        failure puts the running prompts back."""
        self._admitted, self._t_apply = 0, 0.0
        self.save_cursors()
        in_flight = self.receiver is not None
        groups = self.engine.generate(
            self._admit, n=self.cfg.samples_per_prompt, temperature=self.cfg.temperature,
            max_tokens=self.cfg.max_new_tokens, capacity=self.cfg.prompts_per_round,
            weights_ready=self.receiver.ready if in_flight else None,
            apply=self._apply_in_flight if in_flight else None,
            max_version_span=self.cfg.max_version_span)
        try:
            while True:
                t0, apply0 = time.perf_counter(), self._t_apply
                group = next(groups, None)  # engine steps (and in-flight applies) until one finishes
                self._add_time("generate", time.perf_counter() - t0 - (self._t_apply - apply0))
                if group is None:
                    break
                with self.timers("generate"):
                    self._finish_group(group)
        finally:
            groups.close()  # aborts whatever still runs (an engine failure, an injected fault)
            self.orders[None].extend(self._running[::-1])  # generated again, admitted first
            self._running = []
        cap = self.cfg.max_sends_in_flight
        if not self._admitted and not self._stopping and cap and self.transport.progress() >= cap:
            with self.timers("wait"):  # back-pressure: let the sends drain
                time.sleep(0.01)

    def _admit(self):
        """The engine's prompt source: the next prompt that fits, or None (STOP, back-pressure,
        new weights waiting with nothing running, or evaluations to run first)."""
        cap = self.cfg.max_sends_in_flight
        if self.stop_requested():
            return None
        if cap and self.transport.progress() >= cap:
            self.held_back += 1
            return None
        if not self._running and self.receiver is not None and self.receiver.ready():
            return None  # nothing running: the searcher's loop applies the new weights first
        for _ in range(len(self.pools[None])):  # the next prompt that fits (the others: counted)
            i = self._next_prompts(None, 1)[0]
            if self.engine.prompt_fits(self.tokens[i]):
                break
            self.skipped_long += 1
        else:
            return None
        self._running.append(i)
        self._admitted += 1
        if time.time() - self._saved_at > 1.0:
            self.save_cursors()
        return i, self.tokens[i]

    def _apply_in_flight(self) -> None:
        """Called by the engine between two decode steps with no request running: load the
        newest weights, then run the evaluations that came with them (the engine is idle)."""
        t0 = time.perf_counter()
        self._load_newest()
        for v in self._pending_evals:
            with self.timers("eval"):
                self.evaluate(v)
        self._pending_evals = []
        self._t_apply += time.perf_counter() - t0

    def _add_time(self, activity: str, seconds: float) -> None:
        self.timers.seconds[activity] = self.timers.seconds.get(activity, 0.0) + max(seconds, 0.0)

    def _finish_group(self, group) -> None:
        """Score and send one finished group; log once per prompts_per_round groups."""
        if self.rounds + 1 in self._faults and self._window.groups + 1 == self.cfg.prompts_per_round:
            self._faults.discard(self.rounds + 1)
            raise RuntimeError(f"injected engine fault in round {self.rounds + 1}")
        self.dropped_span += group.dropped
        prompts = [self.prompts[group.key]] * len(group.samples)
        texts = [self.engine.decode(x.tokens) for x in group.samples]
        rewards, failed = self.task.rewards(prompts, texts) if texts else (np.zeros(0, np.float32), 0)
        w = self._window
        w.tokens += self._send_round([group.key], [group.samples], rewards, self.engine.version)
        self._running.remove(group.key)  # sent: a restart from here on need not generate it again
        self._failures_in_row = 0
        w.groups, w.failed = w.groups + 1, w.failed + failed
        w.prompts += prompts
        w.texts += texts
        w.rewards.append(rewards)
        if w.groups < self.cfg.prompts_per_round:
            return
        self.rounds += 1
        rewards = np.concatenate(w.rewards)
        span = time.time() - w.t0
        self.log.scalars(self.rounds, {
            "searcher/skipped_long_prompts": self.skipped_long,
            "searcher/dropped_version_span": self.dropped_span,
            "searcher/updates_in_flight": self.engine.updates_in_flight,
            "searcher/reward_mean": float(rewards.mean()) if rewards.size else 0.0,
            "searcher/reward_failures": w.failed,
            "searcher/gen_tokens_per_s": w.tokens / max(span, 1e-9),
            "searcher/round_s": span, "searcher/version": self.engine.version,
            "searcher/groups_running": len(self._running),
            "searcher/admissions_held_back": self.held_back,
            "searcher/sends_in_flight": self.transport.progress(), **self.timers.metrics(),
            **(self.task.round_metrics(w.prompts, w.texts, rewards) if w.texts else {})})
        self._window = Window()


class Window:
    """Continuous generation: what the groups finished since the last log line add up to."""

    def __init__(self) -> None:
        self.t0, self.groups, self.tokens, self.failed = time.time(), 0, 0, 0
        self.prompts: list = []
        self.texts: list[str] = []
        self.rewards: list[np.ndarray] = []
