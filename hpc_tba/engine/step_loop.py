"""vLLM's step loop, as a `VLLMEngine` (engine/vllm_engine.py) drives it for continuous
generation and for rounds with in-flight weight updates.

In-flight updates (`searcher.update=in_flight`, `sample(..., weights_ready=, apply=)`): instead
of `LLM.generate` the engine drives vLLM's `LLMEngine` itself (add_request, then a `step()` loop;
every one of the n samples of a prompt is its own request). Between two steps, when
`weights_ready()` says a new version is staged, the requests still running are aborted, `apply()`
loads the new version in place (`load_weights`, which resets the prefix cache: nothing is
running, so no block is kept), and each aborted request is added again as its continuation (its
prompt plus the tokens generated so far, the remaining token budget). The continuation's prefix
is prefilled under the new weights, so every later token is sampled from exactly the new
version's distribution given the whole prefix: each token is stamped with the version that
produced it, and its behaviour log-prob is that version's log-prob of it, exactly (what a learner
scoring the sequence with that version's weights computes). Cost: one prefill of the running
sequences per update. A stop string that straddles the switch is not seen (the continuation's
stop check starts at the switch); EOS and token budgets are exact. Async scheduling is switched
off in that mode so that a step's tokens all come from the weights loaded before it. A request
hands back its output only once it finishes (FINAL_ONLY: no RequestOutput per running request
per step, as `LLM.generate` does it); what an aborted one generated so far is read from vLLM's
output processor just before the abort. The same loop runs on an out-of-process engine (its
`LLMEngine` is a client of the EngineCore process, and `apply()` reaches the workers through the
channel between two steps).

Continuous generation (`searcher.generation=continuous`, `generate(next_prompt, capacity=...)`):
the same step loop, but it never drains: up to `capacity` groups (the n samples of one prompt)
run at once, a group is yielded as soon as its last sample finishes, and the next prompt is
admitted at once, so the batch stays full and rounds stop being barriers. In-flight updates work
as above; a round in flight (`sample(..., weights_ready=, apply=)`) is this loop with every
prompt admitted at the start. With `max_version_span` a running sample that already holds that
many versions is given up at the next update instead of being re-prefilled (it would be dropped
at send anyway).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from hpc_tba.engine.base import Group, PromptSource, Sample

# Sampling parameters that would change the distribution a token is drawn from, at their neutral
# values: plain softmax(logits / T) sampling, as the learner's log-probs assume.
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "repetition_penalty": 1.0, "watermarking": False,
                    "ignore_eos": False}


def sampling_params(**kwargs):
    """vLLM SamplingParams with the neutral values above written explicitly, plus `kwargs`."""
    from vllm import SamplingParams

    return SamplingParams(**NEUTRAL_SAMPLING, **kwargs)


@dataclasses.dataclass
class StepStats:
    """Counters of `VLLMEngine.generate`'s step loop, summed over every call (never reset)."""

    steps: int = 0  # engine steps taken
    running: int = 0  # requests running at the start of each step, summed (/ steps: the batch)
    apply_s: float = 0.0  # seconds inside apply() (the engine paused for a weight update)
    reprefill_tokens: int = 0  # prompt + generated tokens of the continuations after updates
    step_s: float = 0.0  # seconds inside vLLM's step() (the rest of a call: the loop, its consumer)
    reprefill_steps: int = 0  # steps that followed an update (they re-prefill its continuations)
    reprefill_step_s: float = 0.0  # their seconds (re-prefill + that step's decode)


class StepLoop:
    """One `VLLMEngine.generate` call: the requests running on the engine's `LLMEngine` and the
    groups admitted. A part of the `VLLMEngine` it runs on (`owner`): it reads the owner's
    version, per-request settings and response lengths, and counts into its `step_stats`."""

    def __init__(self, owner, next_prompt: PromptSource, *, n: int, temperature: float,
                 max_tokens: int, capacity: int, weights_ready: Callable[[], bool] | None,
                 apply: Callable[[], None] | None, max_version_span: int):
        if (weights_ready is None) != (apply is None):
            raise ValueError("VLLMEngine.generate: in-flight updates need both weights_ready and apply")
        if capacity < 1 or n < 1:
            raise ValueError(f"VLLMEngine.generate: capacity={capacity} and n={n} must be >= 1")
        self.owner, self.engine = owner, owner.llm.llm_engine
        if self.engine.has_unfinished_requests():
            raise RuntimeError("VLLMEngine: continuous generation needs an idle engine")
        self.next_prompt, self.n, self.temperature = next_prompt, n, temperature
        self.max_tokens, self.capacity, self.max_version_span = max_tokens, capacity, max_version_span
        self.weights_ready, self.apply = weights_ready, apply
        self.runs: dict[str, _Run] = {}  # running requests, by the request id the loop gave them
        self.internal_ids: dict[str, str] = {}  # the same, by the id vLLM made of it (its state's key)
        self.groups: list[_Group] = []  # admitted, not yet yielded, in admission order

    def run(self) -> Iterator[Group]:
        """Steps until nothing runs and nothing is admitted, yielding each finished group."""
        engine, stats, runs = self.engine, self.owner.step_stats, self.runs
        try:
            self._admit()
            after_update = False  # this step re-prefills the continuations of an update
            while runs:
                stats.steps += 1
                stats.running += len(runs)
                t0 = time.perf_counter()
                outs = engine.step()  # FINAL_ONLY: the requests that finished in this step
                took = time.perf_counter() - t0
                stats.step_s += took
                if after_update:
                    stats.reprefill_steps += 1
                    stats.reprefill_step_s += took
                    after_update = False
                for out in outs:
                    c = out.outputs[0]
                    runs.pop(out.request_id).extend(c.token_ids, c.logprobs, self.owner.version, finished=True)
                    del self.internal_ids[out.request_id]
                if outs:
                    yield from self._finished()
                if runs and self.weights_ready is not None and self.weights_ready():
                    self._update()
                    yield from self._finished()
                    after_update = True
                self._admit()
        finally:  # closed early (the consumer stopped, or failed): leave the engine idle
            if runs:
                with contextlib.suppress(Exception):
                    engine.abort_request(list(runs))

    def _update(self) -> None:
        """New weights between two steps: abort what runs (keeping what it generated), apply them,
        and add each sample again as its continuation, or give it up (version span cap)."""
        owner, stats = self.owner, self.owner.step_stats
        running = list(self.runs)
        aborted = [self.runs.pop(rid) for rid in running]
        for rid, run in zip(running, aborted):  # an abort returns nothing: read them first
            run.extend(*_generated_so_far(self.engine, self.internal_ids.pop(rid)), owner.version,
                       finished=False)
        self.engine.abort_request(running)
        t0 = time.perf_counter()
        self.apply()  # load_weights: new version, prefix cache reset (nothing is running)
        stats.apply_s += time.perf_counter() - t0
        owner.updates_in_flight += 1
        for run in aborted:
            if self.max_version_span and len(set(run.versions)) >= self.max_version_span:
                run.finished = run.dropped = True
            else:
                stats.reprefill_tokens += len(run.prompt) + len(run.tokens)
                self._add(run)

    def _add(self, run: _Run) -> None:
        from vllm.sampling_params import RequestOutputKind

        owner = self.owner
        budget, kw = self.max_tokens - len(run.tokens), owner.request_kwargs(len(run.tokens))
        if owner.response_length is not None:  # benchmarks and tests: a length per prompt
            budget = min(self.max_tokens, owner.response_length(run.prompt)) - len(run.tokens)
            kw["min_tokens"] = budget
        params = sampling_params(n=1, temperature=self.temperature, logprobs=0, max_tokens=budget,
                                 output_kind=RequestOutputKind.FINAL_ONLY, **kw)
        rid = f"hpc{next(owner.request_ids)}"
        self.runs[rid] = run
        self.internal_ids[rid] = self.engine.add_request(
            rid, {"prompt_token_ids": list(run.prompt) + run.tokens}, params)

    def _admit(self) -> None:
        while len(self.groups) < self.capacity and (got := self.next_prompt()) is not None:
            group = _Group(got[0], [_Run(list(got[1])) for _ in range(self.n)])
            self.groups.append(group)
            for run in group.runs:
                self._add(run)

    def _finished(self) -> list[Group]:
        done = [g for g in self.groups if all(r.finished for r in g.runs)]
        for g in done:
            self.groups.remove(g)
        return [g.result() for g in done]


def sampled_logprobs(logprobs, token_ids: Sequence[int]) -> list[float]:
    """The log-prob of each sampled token, from vLLM's sample log-probs with `logprobs=0` (the
    sampled token alone at each position, first): flat (FlatLogprobs) or a dict per position."""
    from vllm.logprobs import FlatLogprobs

    if not isinstance(logprobs, FlatLogprobs):
        return [step[t].logprob for step, t in zip(logprobs, token_ids, strict=True)]
    at = logprobs.start_indices
    if [logprobs.token_ids[i] for i in at] != list(token_ids):
        raise RuntimeError("vLLM's sample log-probs are not those of the sampled tokens")
    return [logprobs.logprobs[i] for i in at]


def _generated_so_far(engine, request_id: str) -> tuple[list[int], object]:
    """Token ids and sample log-probs a running request (`request_id`: vLLM's internal id, which
    `LLMEngine.add_request` returns) has generated so far. With FINAL_ONLY outputs an abort on
    `LLMEngine` returns nothing, so they are read, just before it, from the engine's output
    processor (its per-request state; in this process in and out of process)."""
    state = engine.output_processor.request_states.get(request_id)
    if state is None:
        raise RuntimeError(f"VLLMEngine: running request {request_id} has no output state in vLLM")
    return state.detokenizer.output_token_ids, state.logprobs_processor.logprobs


@dataclasses.dataclass
class _Run:
    """One in-flight sample: its prompt and what it generated so far."""

    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    dropped: bool = False  # given up at an update (it would span more than max_version_span)

    def extend(self, token_ids: Sequence[int], logprobs, version: int, *, finished: bool) -> None:
        """Append what one request (the sample's first, or a continuation after an update)
        generated, stamped with the engine's version: a request lives under one version, since
        every update aborts what runs."""
        new = list(token_ids)
        self.tokens += new
        self.logp += sampled_logprobs(logprobs, new)
        self.versions += [version] * len(new)
        self.finished = finished

    def sample(self) -> Sample:
        return Sample(np.asarray(self.tokens, dtype=np.int32), np.asarray(self.logp, dtype=np.float32),
                      np.asarray(self.versions, dtype=np.int64))


@dataclasses.dataclass
class _Group:
    """The n runs of one admitted prompt (continuous generation)."""

    key: object
    runs: list[_Run]

    def result(self) -> Group:
        return Group(self.key, [r.sample() for r in self.runs if not r.dropped],
                     sum(r.dropped for r in self.runs))
