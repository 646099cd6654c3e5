"""A second engine is one module: a small pure-Python engine with the members of
`hpc_tba.engine.base.Engine` is driven by the real Searcher for a whole run (evaluation, one
round, STOP, DONE) and by `hpc-tba eval`; VLLMEngine has the protocol's methods with the same
signatures. No vLLM, no MPI: seconds."""
from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from hpc_tba.comm.transport import Transport
from hpc_tba.engine.base import Engine, Sample
from hpc_tba.messages import Done, EvalReport, Stop, TrajectoryBatch

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
    assert {"tokenize", "decode", "prompt_fits", "sample", "greedy", "score", "load_weights",
            "close"} <= set(methods)
    for name in methods:
        want = list(inspect.signature(getattr(Engine, name)).parameters)
        assert list(inspect.signature(getattr(VLLMEngine, name)).parameters) == want, name
        assert list(inspect.signature(getattr(DigitEngine, name)).parameters) == want, name


def test_the_real_searcher_runs_a_round_on_a_python_engine(tmp_path):
    from hpc_tba.config import SearcherConfig
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import TaskConfig, build_task
    from hpc_tba.topology import Topology

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
    from hpc_tba import eval_cli
    from hpc_tba.assembly import engines

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
