"""One model built at a time per process (hpc_tba.models.construction).

The in-process runner's whole-loop test failed in about one full suite in three: its searcher
thread built the vLLM engine while the learner thread's `deepspeed.zero.Init` was open, and the
engine's embedding was partitioned to 0 columns. The first test opens a real zero.Init window in
one thread and builds a module in another, without the lock (the race, shown) and with it; the
second checks that every model a role builds is built under the lock.
"""
from __future__ import annotations

import contextlib
import threading

import pytest
from conftest import gloo_deepspeed, spawn_ranks

from hpc_tba.comm.groups import free_ports
from hpc_tba.models.construction import building, held_here

WINDOW_S = 3.0  # how long the zero.Init window waits for the other thread's build to end


def _zero_init_window(rank: int, port: int) -> dict:
    gloo_deepspeed(rank, 1, port)
    return {guarded: _build_beside_a_window(guarded) for guarded in (False, True)}


def _build_beside_a_window(guarded: bool) -> dict:
    """One thread holds a zero.Init window open (under the lock, as load_causal_lm does) while
    another builds a module, under the lock or not."""
    import deepspeed
    import torch

    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                 "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    opened, built, seen = threading.Event(), threading.Event(), {}

    def learner() -> None:
        with building(), deepspeed.zero.Init(config_dict_or_path=ds_config):
            opened.set()
            seen["built_inside_window"] = built.wait(WINDOW_S)

    def other() -> None:
        opened.wait()
        with building() if guarded else contextlib.nullcontext():
            module = torch.nn.Embedding(16, 8)
        seen["shape"] = tuple(module.weight.shape)
        seen["partitioned"] = hasattr(module.weight, "ds_id")
        built.set()

    threads = [threading.Thread(target=learner), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return seen


def test_a_zero_init_window_partitions_other_threads_builds_unless_they_hold_the_lock():
    out = spawn_ranks(_zero_init_window, 1, (free_ports(1)[0],), timeout_s=180)[0]
    race, guarded = out[False], out[True]
    # the race itself: a module built in another thread during the window is partitioned
    assert race["built_inside_window"] and race["partitioned"], race
    # under the lock it waits for the window to close and is built whole
    assert guarded == {"built_inside_window": False, "shape": (16, 8), "partitioned": False}, guarded


class _Recorded(Exception):
    """Raised by a stand-in constructor once it has recorded whether the lock was held."""


@pytest.fixture
def record(monkeypatch):
    """Replace `owner.name` by a constructor that records `held_here()` and raises _Recorded."""
    def patch(owner, name: str) -> list[bool]:
        seen: list[bool] = []

        def constructor(*args, **kwargs):
            seen.append(held_here())
            raise _Recorded

        monkeypatch.setattr(owner, name, constructor)
        return seen
    return patch


def _tiny_model() -> str:
    from hpc_tba.config import ModelConfig, TaskConfig
    from hpc_tba.tasks.embedded import resolve_model_path

    return resolve_model_path(ModelConfig(), TaskConfig())


def test_every_model_a_role_builds_is_built_under_the_lock(record):
    import torch
    import transformers

    from hpc_tba.config import SearcherConfig
    from hpc_tba.engine.vllm_engine import VLLMEngine
    from hpc_tba.models.loading import load_causal_lm
    from hpc_tba.tasks.preference import RewardModel
    from hpc_tba.tasks.redteam import HFVictim

    path = _tiny_model()
    builds = {
        "learner policy": (transformers.AutoModelForCausalLM, "from_pretrained",
                           lambda: load_causal_lm(path, dtype=torch.float32, zero3_config=None, rank=0)),
        "reward model": (transformers.AutoModelForSequenceClassification, "from_pretrained",
                         lambda: RewardModel(path)),
        "victim": (transformers.AutoModelForCausalLM, "from_pretrained", lambda: HFVictim(path)),
        "engine": (VLLMEngine, "_build", lambda: VLLMEngine(path, SearcherConfig(), seed=0)),
    }
    for what, (owner, name, build) in builds.items():
        seen = record(owner, name)
        assert not held_here()
        with pytest.raises(_Recorded):
            build()
        assert seen == [True], f"{what}: built outside hpc_tba.models.construction.building()"
        assert not held_here(), f"{what}: the lock stayed held after a failed build"
