"""Checkpoints are read with torch.load(weights_only=True): nothing in a checkpoint file runs.

- A checkpoint written by `checkpoint.save` (1-rank ZeRO-3 engine of a tiny Llama) loads into a
  fresh engine bit-exactly (weights, fp32 master partitions, Adam moments, scheduler, RNG) and the
  next step matches; DeepSpeed's own model/optimizer files went through the weights_only path.
- The allow-list for DeepSpeed's non-tensor objects is minimal: each entry is needed.
- A file replaced by a pickle whose `__reduce__` would create a marker file is refused with one
  CheckpointError naming the file, and the marker is never created (ours and DeepSpeed's files).
- No module of hpc_tba (or tools/) deserialises with pickle.
"""
from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO

from hpc_tba.checkpoint import store as checkpoint
from hpc_tba.checkpoint.store import CheckpointError, load_tensors

BATCH, SEQ, VOCAB = 4, 12, 32


class _Planted:
    """Unpickling this creates `marker` (stands in for arbitrary code in a tampered file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def _plant(path: Path, marker: Path, *, zip_format: bool) -> None:
    """Replace `path` by a malicious pickle: torch.save's zip format or a raw pickle stream."""
    payload = {"module": _Planted(str(marker)), "optimizer_state_dict": None}
    if zip_format:
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload, protocol=2))  # the protocol torch.load reads


# ---------------------------------------------------------------- no DeepSpeed needed


def test_load_tensors_accepts_tensors_and_refuses_code(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"cpu": torch.get_rng_state(), "n": 3, "shape": torch.Size([2])}, good)
    assert load_tensors(str(good))["n"] == 3

    marker = tmp_path / "pwned"
    for zip_format in (True, False):
        bad = tmp_path / f"bad_{zip_format}.pt"
        _plant(bad, marker, zip_format=zip_format)
        with pytest.raises(CheckpointError) as e:
            load_tensors(str(bad))
        msg = str(e.value)
        assert str(bad) in msg and "refused" in msg and "open" in msg, msg
        assert "\n" not in msg  # one clear line, not torch's page of advice
        assert not marker.exists(), "the planted pickle ran"

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match="garbage.pt is unreadable"):
        load_tensors(str(garbage))
    with pytest.raises(CheckpointError, match="missing.pt is unreadable"):
        load_tensors(str(tmp_path / "missing.pt"))


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


IN_MEMORY_PICKLE = {
    ("hpc_tba/engine/worker_ext.py", "pickle.loads"):
        "a CUDA IPC handle from a searcher to its own vLLM workers, in memory, never persisted",
}
"""Unpickling that reads no file, each with its reason; anything else fails the test below."""


def test_package_never_unpickles_without_weights_only():
    """Every torch.load in hpc_tba and tools passes weights_only=True; nothing else unpickles a file."""
    offenders = []
    for path in sorted([*Path(REPO, "hpc_tba").rglob("*.py"), *Path(REPO, "tools").rglob("*.py")]):
        tree = ast.parse(path.read_text(), filename=str(path))
        for call, func in _calls(tree):
            where = f"{path.relative_to(REPO)}:{call.lineno}: {func}"
            kw = {k.arg: k.value for k in call.keywords}
            if func.endswith("torch.load"):
                ok = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                if not ok:
                    offenders.append(where + " without weights_only=True")
            if func.split(".")[-1] in ("loads", "load", "Unpickler") and func.split(".")[0] in (
                    "pickle", "cPickle", "cloudpickle", "dill", "_pickle"):
                if (str(path.relative_to(REPO)), func) not in IN_MEMORY_PICKLE:
                    offenders.append(where)
            if any(isinstance(v, ast.Constant) and v.value is True and k == "allow_pickle"
                   for k, v in kw.items()):
                offenders.append(where + " allow_pickle=True")
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "weights_only" and isinstance(
                    node.value, ast.Constant) and node.value.value is False:
                offenders.append(f"{path.relative_to(REPO)}:{node.value.lineno}: weights_only=False")
    assert offenders == []


# ---------------------------------------------------------------- a real ZeRO-3 checkpoint


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(n)]


def _engine(seed: int):
    """A 1-rank ZeRO-3 engine built as the learner builds its own (AdamW + warm-up LambdaLR)."""
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_tba.config import LearnerConfig
    from hpc_tba.roles.learner import deepspeed_config

    torch.manual_seed(seed)
    cfg = LearnerConfig(lr=1e-2, warmup_steps=3)
    ds = deepspeed_config(cfg, micro_batch=BATCH, train=True)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds)
    return engine


def _step(engine, ids: torch.Tensor) -> float:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _snapshot(engine) -> dict:
    """Everything resume must restore, as plain tensors and numbers."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        weights = {n: p.detach().clone() for n, p in params.items()}
    zero = engine.optimizer.state_dict()
    adam = zero["optimizer_state_dict"]["state"]
    return {"weights": weights,
            "fp32": [t.clone() for t in zero["fp32_flat_groups"]],
            "adam": {f"{k}.{name}": v.clone() for k, st in adam.items() for name, v in st.items()},
            "sched": engine.lr_scheduler.state_dict(), "global_steps": engine.global_steps,
            "rng": torch.get_rng_state()}


def _differences(a: dict, b: dict) -> list[str]:
    out = []
    for key in ("weights", "adam"):
        if a[key].keys() != b[key].keys():
            out.append(f"{key}: different names")
        out += [f"{key}.{n}" for n in a[key] if n in b[key] and not torch.equal(a[key][n], b[key][n])]
    out += [f"fp32[{i}]" for i, (x, y) in enumerate(zip(a["fp32"], b["fp32"])) if not torch.equal(x, y)]
    out += [k for k in ("sched", "global_steps") if a[k] != b[k]]
    out += ["rng"] if not torch.equal(a["rng"], b["rng"]) else []
    return out


def _tampered_loads(engine, ckpt: Path, scratch: Path) -> dict[str, str]:
    """Load copies of `ckpt` with one file replaced by a planted pickle; the errors they raise."""
    marker = scratch / "pwned"
    ds = ckpt / "ds"
    cases = {"model_states": (next(ds.glob("*model_states.pt")), True),
             "optim_states": (next(ds.glob("*optim_states.pt")), False),
             "rng": (ckpt / "rng_rank0.pt", True)}
    out = {}
    for case, (victim, zip_format) in cases.items():
        copy = scratch / case
        shutil.copytree(ckpt, copy)
        target = copy / victim.relative_to(ckpt)
        _plant(target, marker, zip_format=zip_format)
        try:
            checkpoint.load(engine, str(copy), learner_rank=0)
            out[case] = "loaded"
        except CheckpointError as e:
            out[case] = str(e).replace(str(target), "<FILE>")
        out[case + "_marker"] = marker.exists()
    return out


def _allow_list_needed(ckpt: Path) -> dict[str, bool]:
    """For each allowed class: does DeepSpeed's optimizer file fail to load without it?"""
    allowed = checkpoint.deepspeed_safe_globals()
    optim = str(next((ckpt / "ds").glob("*optim_states.pt")))
    needed = {}
    for cls in allowed:
        try:
            load_tensors(optim, allowed=[c for c in allowed if c is not cls])
            needed[cls.__name__] = False
        except CheckpointError:
            needed[cls.__name__] = True
    for f in (ckpt / "ds").glob("*.pt"):
        load_tensors(str(f), allowed=allowed)  # raises if a DeepSpeed file needs anything else
    return needed


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    tmp_path, batches = Path(tmp), _batches(3)
    a = _engine(seed=0)
    for ids in batches[:2]:
        _step(a, ids)
    ckpt = Path(checkpoint.save(a, run_dir=str(tmp_path / "run"), step=2, learner_rank=0,
                                shard_state={"shard": 0}, learner_state={"step": 2}, keep_last=1))
    saved = _snapshot(a)
    loss_a = _step(a, batches[2])
    after_a = _snapshot(a)

    b = _engine(seed=1)  # different initial weights: a no-op load cannot pass
    fresh = _differences(_snapshot(b), saved)
    report = {"tampered": _tampered_loads(b, ckpt, tmp_path / "scratch")}
    t0 = time.perf_counter()
    learner_state, shard_state = checkpoint.load(b, str(ckpt), learner_rank=0)
    report["load_s"] = time.perf_counter() - t0
    report["states"] = [learner_state, shard_state]
    report["fresh_differs"] = bool(fresh)
    report["after_load"] = _differences(_snapshot(b), saved)
    report["losses"] = [loss_a, _step(b, batches[2])]
    report["after_step"] = _differences(_snapshot(b), after_a)
    report["needed"] = _allow_list_needed(ckpt)
    (tmp_path / "report.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    import torch.multiprocessing as mp

    from hpc_tba.comm.groups import free_ports

    tmp = tmp_path_factory.mktemp("trust")
    mp.spawn(_worker, args=(free_ports(1)[0], str(tmp)), nprocs=1, join=True)
    return json.loads((tmp / "report.json").read_text())


def test_resume_from_weights_only_load_is_bit_exact(report):
    assert report["fresh_differs"], "vacuous: the fresh engine already equals the checkpoint"
    assert report["states"] == [{"step": 2}, {"shard": 0}]
    assert report["after_load"] == []
    assert report["losses"][0] == report["losses"][1]  # the step after resume: bit for bit
    assert report["after_step"] == []


def test_deepspeed_allow_list_is_minimal(report):
    assert report["needed"] == {"ZeroStageEnum": True, "LossScaler": True}


@pytest.mark.parametrize("case", ["model_states", "optim_states", "rng"])
def test_tampered_checkpoint_file_is_refused_without_running_it(report, case):
    msg = report["tampered"][case]
    assert not report["tampered"][case + "_marker"], f"the planted pickle in {case} ran"
    assert msg.startswith("checkpoint file <FILE> refused:"), msg
    assert "open" in msg and "\n" not in msg
