"""A second engine is one module: a small pure-Python engine with the members of
`hpc_tba.engine.base.Engine` is driven by the real Searcher for a whole run (evaluation, one
round, STOP, DONE), for continuous generation (groups sent as they finish, in-flight versions,
back-pressure, STOP draining, cursors of running groups) and by `hpc-tba eval`; VLLMEngine has
the protocol's methods with the same signatures. No vLLM, no MPI: seconds."""
from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from hpc_tba.comm.messages import Done, EvalReport, Stop, TrajectoryBatch
from hpc_tba.comm.transport import Transport
from hpc_tba.engine.base import Engine, Group, Sample

DIGITS = [ord(c) for c in "0123456789"]


class DigitEngine:
    """Characters are tokens; a response is 1..max_tokens digits drawn uniformly, so the exact
    log-prob of every sampled token is log(1/10)."""

    def __init__(self, seed: int = 0, max_model_len: int = 64, max_new_tokens: int = 4):
        self.version, self.updates_in_flight = 0, 0
        self.rng = np.random.default_rng(seed)
        self.room = max_model_len - max_new_tokens
        self.loads: list[int] = []
        self.closed = False

    def tokenize(self, texts):
        return [[ord(c) for c in t] for t in texts]

    def decode(self, tokens):
        return "".join(chr(t) for t in tokens)

    def prompt_fits(self, prompt):
        return len(prompt) <= self.room

    def sample(self, prompts, *, n, temperature, max_tokens, seed=None, weights_ready=None, apply=None):
        out = []
        for _ in prompts:
            row = []
            for _ in range(n):
                tokens = self.rng.choice(DIGITS, size=int(self.rng.integers(1, max_tokens + 1)))
                row.append(Sample(tokens.astype(np.int32), np.full(len(tokens), np.log(0.1), np.float32)))
            out.append(row)
        return out

    def generate(self, next_prompt, *, n, temperature, max_tokens, capacity, weights_ready=None,
                 apply=None, max_version_span=0):
        """One digit per running sample per step; `length_of(prompt)` (if set) fixes a sample's
        length, else it is drawn. New weights between steps, every token stamped."""
        groups = []  # [key, runs], a run = [target length, tokens, versions, dropped]
        self.peak_running = getattr(self, "peak_running", 0)

        def admit():
            while len(groups) < capacity and (got := next_prompt()) is not None:
                length = getattr(self, "length_of", None)
                runs = [[min(max_tokens, length(got[1]) if length else int(self.rng.integers(1, max_tokens + 1))),
                         [], [], False] for _ in range(n)]
                groups.append([got[0], runs])
            self.peak_running = max(self.peak_running, len(groups))

        def live(r):
            return not r[3] and len(r[1]) < r[0]

        def finished():
            done = [g for g in groups if not any(live(r) for r in g[1])]
            for g in done:
                groups.remove(g)
                samples = [Sample(np.array(r[1], np.int32), np.full(len(r[1]), np.log(0.1), np.float32),
                                  np.array(r[2], np.int64)) for r in g[1] if not r[3]]
                yield Group(g[0], samples, sum(r[3] for r in g[1]))

        admit()
        while any(live(r) for g in groups for r in g[1]):
            for g in groups:
                for r in g[1]:
                    if live(r):
                        r[1].append(int(self.rng.choice(DIGITS)))
                        r[2].append(self.version)
            yield from finished()
            running = [r for g in groups for r in g[1] if live(r)]
            if running and weights_ready is not None and weights_ready():
                apply()
                self.updates_in_flight += 1
                for r in running:
                    r[3] = bool(max_version_span) and len(set(r[2])) >= max_version_span
                yield from finished()
            admit()

    def greedy(self, prompts, *, max_tokens):
        return [[DIGITS[0]] for _ in prompts]

    def score(self, prompt, response, *, temperature):
        return np.full(len(response), np.log(0.1), np.float32)

    def load_weights(self, named_tensors, version):
        if version < self.version:
            raise ValueError("weight version went backwards")
        self.loads.append(version)
        self.version = version

    def close(self):
        self.closed = True


class _Transport:
    """What a searcher asks of its transport (hpc_tba.comm.transport.Transport); every message is
    packed and unpacked as on the wire, and STOP arrives after the first round."""

    rank, size = 2, 3

    def __init__(self):
        self.sent, self.sent_to, self.stop_polls = [], {}, 0

    def send(self, dest, message):
        self.sent.append((dest, type(message).unpack(message.pack())))
        if isinstance(message, TrajectoryBatch):
            self.sent_to[dest] = self.sent_to.get(dest, 0) + 1

    def receive(self, kind, *, max_messages=1 << 30):
        assert kind is Stop
        self.stop_polls += 1
        return [(0, Stop(1))] if self.stop_polls > 1 else []

    def progress(self):
        return 0

    def flush(self):
        pass

    def bcast_json(self, obj, *, root=0):
        return obj

    def allgather_json(self, obj):
        return [obj] * self.size

    def barrier(self):
        pass

    def abort(self, code=1):
        raise AssertionError(f"abort({code})")

    def of(self, kind):
        return [(d, m) for d, m in self.sent if isinstance(m, kind)]


def test_a_python_engine_satisfies_the_protocol_and_vllm_has_its_signatures():
    assert isinstance(DigitEngine(), Engine)
    assert not isinstance(object(), Engine)
    from hpc_tba.engine.vllm_engine import VLLMEngine

    methods = [n for n, v in vars(Engine).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"tokenize", "decode", "prompt_fits", "sample", "generate", "greedy", "score",
            "load_weights", "close"} <= set(methods)
    for name in methods:
        want = list(inspect.signature(getattr(Engine, name)).parameters)
        assert list(inspect.signature(getattr(VLLMEngine, name)).parameters) == want, name
        assert list(inspect.signature(getattr(DigitEngine, name)).parameters) == want, name


def test_the_real_searcher_runs_a_round_on_a_python_engine(tmp_path):
    from hpc_tba.config import SearcherConfig
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import TaskConfig, build_task

    cfg = SearcherConfig(prompts_per_round=3, samples_per_prompt=2, k=2, max_new_tokens=4)
    engine, transport, topo = DigitEngine(), _Transport(), Topology.build(3, 2, 1)
    assert isinstance(transport, Transport)
    s = Searcher(cfg=cfg, task=build_task(TaskConfig()), engine=engine, receiver=None,
                 transport=transport, topo=topo, index=0, run_dir=str(tmp_path))
    s.run()
    s.close()
    assert s.rounds == 1 and engine.closed
    trajectories = transport.of(TrajectoryBatch)
    assert len(trajectories) == 3 == s.sent
    for dest, batch in trajectories:
        assert dest == topo.shard_of_prompt(batch.prompt_id) and batch.policy_version == 0
        assert len(batch.lengths) == 2 and batch.lengths.sum() == len(batch.response_tokens)
        assert set(batch.response_tokens.tolist()) <= set(DIGITS)
        assert np.allclose(batch.logp_behavior, np.log(0.1))
        assert batch.rewards.shape == (2,)
    evals = transport.of(EvalReport)
    assert len(evals) == 1 and evals[0][0] == 0
    assert evals[0][1].policy_version == 0 and evals[0][1].total == len(s.test) > 0
    done = {d: m.sent for d, m in transport.of(Done)}
    assert done == {r: transport.sent_to.get(r, 0) for r in topo.learner_ranks}
    summary = json.loads((tmp_path / "summary_searcher0.json").read_text())
    assert summary["rounds"] == 1 and summary["sent"] == 3


def test_hpc_tba_eval_runs_on_a_python_engine(tmp_path, monkeypatch, capsys):
    from hpc_tba.assembly import engines
    from hpc_tba.cli import eval as eval_cli

    built = []

    def build(cfg, model_path, *, seed, device=None, warm_prompt=None):
        built.append(DigitEngine(seed, cfg.searcher.max_model_len, cfg.searcher.max_new_tokens))
        return built[-1]

    monkeypatch.setattr(engines, "build_engine", build)
    monkeypatch.setenv("HPC_TBA_NO_PROGRESS", "1")
    out = tmp_path / "eval"
    assert eval_cli.eval_main(["--model", str(_hf_dir(tmp_path)), "--samples", "2", "--limit", "5",
                               "--out", str(out)]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["num_prompts"] == 5 and report["metrics"]["eval/num_prompts"] == 5
    rows = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(r["greedy"] == "0" and len(r["samples"]) == 2 for r in rows)
    assert len(built) == 1 and built[0].closed
    assert "eval/pass@1_greedy" in capsys.readouterr().out


def _hf_dir(tmp_path):
    """A directory `hpc-tba eval --model` accepts (the engine here never reads it)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


@pytest.mark.parametrize("bad", ["tokenize", "load_weights"])
def test_a_class_missing_a_member_is_not_an_engine(bad):
    cls = type("Partial", (DigitEngine,), {bad: None})
    assert not isinstance(cls(), Engine)


class _Versions:
    """Receiver stand-in: stages version 1, 2, ... every `every` calls of ready(); version 2
    comes with an evaluation request (asked while groups are running)."""

    def __init__(self, every: int):
        from hpc_tba.comm.weight_sync import StagedWeights

        self.staged, self.every, self.calls, self.version, self.pending = StagedWeights, every, 0, 0, False
        self.received_versions, self.stopped = [], False
        self.staging, self.skipped_versions = "host", []  # a whole version staged, none skipped

    def ready(self):
        self.calls += 1
        self.pending = self.pending or self.calls % self.every == 0
        return self.pending

    def take(self):
        if not self.pending:
            return None, []
        self.pending, self.version = False, self.version + 1
        self.received_versions.append(self.version)
        return self.staged(self.version, 0, []), [self.version] if self.version == 2 else []

    def current(self):  # the version staged last, whole (what a rebuilt engine reloads)
        return self.staged(self.version, 0, []) if self.version else None

    def reading(self):
        import contextlib

        return contextlib.nullcontext()

    def join(self, timeout=None):
        pass


class _Continuous(_Transport):
    """STOP after `polls` polls; progress(): trajectory sends not yet taken, one taken every
    third poll (the searcher polls at every admission: sends pile up)."""

    def __init__(self, polls: int):
        super().__init__()
        self.polls, self.taken = polls, 0

    def receive(self, kind, *, max_messages=1 << 30):
        self.stop_polls += 1
        self.taken += self.stop_polls % 3 == 0
        return [(0, Stop(1))] if self.stop_polls > self.polls else []

    def progress(self):
        self.taken = min(self.taken, self.sent_count())
        return self.sent_count() - self.taken

    def sent_count(self):
        return len(self.of(TrajectoryBatch))


def _continuous(tmp_path, transport, receiver=None, engine=None, **overrides):
    from hpc_tba.config import SearcherConfig
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import TaskConfig, build_task

    cfg = SearcherConfig(**{"generation": "continuous", "update": "in_flight", "prompts_per_round": 2,
                            "samples_per_prompt": 3, "k": 2, "max_new_tokens": 6, **overrides})
    s = Searcher(cfg=cfg, task=build_task(TaskConfig()), engine=engine or DigitEngine(),
                 receiver=receiver, transport=transport, topo=Topology.build(3, 2, 1), index=0,
                 run_dir=str(tmp_path), engine_factory=lambda: DigitEngine(1))
    admitted, blocked, admit = [], [], s._admit

    def spy():  # what was admitted, and the sends in flight when it was
        got = admit()
        if got is not None:
            admitted.append((got[0], transport.progress()))
        elif not s._stopping:
            blocked.append(transport.progress())
        return got

    s._admit = spy
    return s, admitted, blocked


def test_continuous_generation_on_a_python_engine_sends_drains_and_bounds(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_TBA_FAULT_ENGINE_ROUNDS", "3")
    transport, rx = _Continuous(polls=25), _Versions(every=4)
    s, admitted, blocked = _continuous(tmp_path, transport, rx, max_sends_in_flight=2)
    s.run()
    s.close()
    sent = transport.of(TrajectoryBatch)
    assert s.restarts == 1 and s.engine.version == rx.version > 2  # the fault, then carried on
    # every admitted group was sent (those running at the fault: generated again); STOP drained
    assert {s.prompts[i].id for i, _ in admitted} == {b.prompt_id for _, b in sent}
    assert len(sent) == s.sent and len(admitted) - len(sent) in (1, 2)
    done = {d: m.sent for d, m in transport.of(Done)}
    assert done == {r: transport.sent_to.get(r, 0) for r in s.topo.learner_ranks} and sum(done.values()) == s.sent
    # back-pressure: never admitted with 2 sends in flight, and it did hold admissions back
    assert max(p for _, p in admitted) < 2 and blocked and max(blocked) >= 2
    assert s.engine.peak_running <= 2
    mixed = 0
    for _, b in sent:
        assert b.num_responses == 3 and b.policy_version == int(b.versions().min())
        for v in np.split(b.versions(), np.cumsum(b.lengths)[:-1]):
            assert np.all(np.diff(v) >= 0)
            mixed += len(np.unique(v)) > 1
    assert mixed and s.engine.updates_in_flight > 0
    assert {m.policy_version for _, m in transport.of(EvalReport)} == {0, 2}  # 2: asked in flight
    assert s.rounds >= len(sent) // 2 - 1  # one log line per prompts_per_round finished groups


def test_continuous_sends_a_group_as_soon_as_it_finishes(tmp_path):
    transport = _Continuous(polls=6)
    engine = DigitEngine()
    s, admitted, _ = _continuous(tmp_path, transport, engine=engine, max_sends_in_flight=0)
    s.orders[None] = [i for i in range(len(s.prompts)) if i != 0][:8] + [0]  # prompt 0 first
    slow = s.tokens[0]
    engine.length_of = lambda p: 6 if list(p) == list(slow) else 1
    s.run()
    s.close()
    order = [b.prompt_id for _, b in transport.of(TrajectoryBatch)]
    first = order.index(s.prompts[0].id)
    assert first >= 3, order  # groups admitted after prompt 0 (and after others finished) came first
    assert [i for i, _ in admitted][:3] == [0, 8, 7]


def test_continuous_back_pressure_admits_nothing_and_cursors_hold_running_groups(tmp_path):
    import time

    class Full(_Transport):
        def progress(self):
            return 5

        def receive(self, kind, *, max_messages=1 << 30):
            return []  # no STOP

    s, admitted, _ = _continuous(tmp_path, Full(), max_sends_in_flight=5)
    t0 = time.perf_counter()
    s.generate_continuous()
    assert not admitted and s.sent == 0 and time.perf_counter() - t0 >= 0.01  # waited, nothing ran
    s.cfg.max_sends_in_flight = 0
    a, b = s._admit()[0], s._admit()[0]  # two groups admitted, neither finished
    s.save_cursors()
    again, _, _ = _continuous(tmp_path, Full())
    again.load_cursors()
    assert again._admit()[0] == a and again._admit()[0] == b  # a resumed run generates them again
    s.log.close()
    again.log.close()


def test_continuous_is_refused_between_rounds_and_in_sync_mode(tmp_path):
    from hpc_tba.config import SearcherConfig

    with pytest.raises(ValueError, match="needs searcher.update=in_flight"):
        SearcherConfig(generation="continuous")
    with pytest.raises(ValueError, match="generation"):
        SearcherConfig(generation="always", update="in_flight")
    from hpc_tba.config.topology import Topology
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import TaskConfig, build_task

    with pytest.raises(ValueError, match="learner.mode=sync"):
        Searcher(cfg=SearcherConfig(generation="continuous", update="in_flight"),
                 task=build_task(TaskConfig()), engine=DigitEngine(), receiver=None,
                 transport=_Transport(), topo=Topology.build(3, 2, 1), index=0,
                 run_dir=str(tmp_path), on_policy_quota={0: 1, 1: 1})
