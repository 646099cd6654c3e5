"""Every setting is the one the run uses (issue 23): the DeepSpeed options the learner writes,
read back from real engines (one gloo rank, DeepSpeed's CPU accelerator).

`learner.grad_clip=0` means no clipping: DeepSpeed 0.19.8 clips at 1.0 when the config leaves
`gradient_clipping` out, so the learner always writes it. The numeric check uses SGD, whose step
is proportional to the gradient (Adam's first step hardly depends on the gradient's scale), on a
gradient of norm ~2,900. Further sections: vLLM options read back from a tiny in-process engine,
GPU placement before MPI (a rank entry with an import hook standing in for mpi4py), Slurm CPUs per
role.
"""
from __future__ import annotations

import functools

import pytest
import torch
from conftest import gloo_deepspeed, spawn_ranks

from hpc_tba.comm.groups import free_ports

LR = 0.1


@functools.cache
def _cfg(*overrides: str):
    """A composed run config (composed once per module: Hydra takes ~1 s; not modified)."""
    from hpc_tba.assembly.compose import compose

    return compose(list(overrides))


def _sgd_step(cfg) -> dict:
    """One SGD step through the DeepSpeed engine built from the learner's config for `cfg`, on a
    fixed gradient G (loss = sum(W * G)); returns the step taken, G and what the engine reports."""
    import deepspeed

    from hpc_tba.roles.learner import deepspeed_config

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, bias=False)
    grad = torch.arange(64, dtype=torch.float32).reshape(8, 8) * 10.0  # norm ~2,900
    ds = deepspeed_config(cfg, micro_batch=1, train=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=ds)
    w = engine.module.weight
    with deepspeed.zero.GatheredParameters([w]):
        before = w.detach().clone().float()
    out = engine(torch.eye(8, dtype=w.dtype))  # = W^T (ZeRO-3 gathers W inside the forward)
    loss = (out * grad.t().to(out.dtype)).sum()  # = sum(W * G): dloss/dW = G
    engine.backward(loss)
    engine.step()
    with deepspeed.zero.GatheredParameters([w]):
        after = w.detach().clone().float()
    return {"step": (after - before).numpy(), "grad": grad.numpy(), "clip": engine.gradient_clipping()}


def _effective(learner) -> dict:
    """The settings a DeepSpeed engine built from the learner's config for `learner` runs with,
    read back from the engine (a small module: the values do not depend on the model)."""
    import deepspeed

    from hpc_tba.roles.learner import deepspeed_config

    dtype = torch.bfloat16 if learner.dtype == "bf16" else torch.float32
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(dtype)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                      config=deepspeed_config(learner, micro_batch=2, train=True))
    opt = engine.optimizer
    model_dtype, accum = engine.get_data_types()
    return {"stage": engine.zero_optimization_stage(), "bf16": engine.bfloat16_enabled(),
            "fp16": engine.fp16_enabled(), "clip": engine.gradient_clipping(),
            "param_dtype": str(model_dtype), "grad_accum_dtype": str(accum),
            # the ZeRO-3 partition buffer the micro-batches' gradients are summed into
            "grad_buffer_dtype": str(opt.grad_partitions_flat_buffer.dtype),
            "optimizer_accum_dtype": str(opt.gradient_accumulation_dtype),
            "communication_dtype": str(engine.communication_data_type),
            "persistence_threshold": engine.zero_param_persistence_threshold(),
            # a 64-element weight: whole on every rank iff the threshold is >= 64
            "persistent": [bool(p.ds_persist) for p in engine.module.parameters()],
            "gradient_average": engine.gradient_average, "postscale": engine.postscale_gradients(),
            "predivide": engine.gradient_predivide_factor(),
            "quantized": [engine.zero_quantized_weights(), engine.zero_quantized_gradients(),
                          engine.zero_quantized_nontrainable_weights()],
            "weights": sorted({str(t.dtype) for p in engine.module.parameters() for t in (p, p.ds_tensor)})}


def _worker(rank: int, port: int) -> dict:
    from hpc_tba.config import LearnerConfig

    gloo_deepspeed(rank, 1, port)
    return {"clip0": _sgd_step(LearnerConfig(grad_clip=0.0)),
            "clip05": _sgd_step(LearnerConfig(grad_clip=0.5)),
            "default": _effective(_cfg().learner),
            "tba_70b": _effective(_cfg("+experiment=tba_70b").learner)}


@pytest.fixture(scope="module")
def engines() -> dict:
    return spawn_ranks(_worker, 1, (free_ports(1)[0],), timeout_s=300)[0]


def test_grad_clip_zero_means_no_clipping(engines):
    import numpy as np

    off, on = engines["clip0"], engines["clip05"]
    # unclipped: the SGD step is exactly -lr * G (DeepSpeed's default would scale it by 1/||G||)
    np.testing.assert_allclose(off["step"], -LR * off["grad"], rtol=1e-5, atol=1e-6)
    assert off["clip"] == 0.0 and on["clip"] == 0.5  # what the engine uses, read back
    g = on["grad"]
    np.testing.assert_allclose(on["step"], -LR * g * 0.5 / np.linalg.norm(g), rtol=1e-4, atol=1e-7)


def _expected(learner) -> dict:
    bf16 = learner.dtype == "bf16"
    dtype = "torch.bfloat16" if bf16 else "torch.float32"
    return {"stage": learner.zero_stage, "bf16": bf16, "fp16": False, "clip": learner.grad_clip,
            "param_dtype": dtype, "grad_accum_dtype": "torch.float32",
            "grad_buffer_dtype": "torch.float32", "optimizer_accum_dtype": "torch.float32",
            "communication_dtype": dtype, "persistence_threshold": learner.param_persistence_threshold,
            "persistent": [learner.param_persistence_threshold >= n for n in (64, 8, 64, 8)],
            "gradient_average": True, "postscale": True, "predivide": 1.0,
            "quantized": [False, False, False], "weights": [dtype]}


@pytest.mark.parametrize("preset", ["default", "tba_70b"])
def test_engine_runs_with_the_configured_settings(engines, preset):
    """The default config (fp32, every parameter sharded) and the 70B preset's learner (bf16,
    DeepSpeed's persistence threshold): what the built engine reports equals the config."""
    learner = (_cfg() if preset == "default" else _cfg(f"+experiment={preset}")).learner
    assert engines[preset] == _expected(learner)


def test_the_70b_preset_deepspeed_config():
    """The dict the 70B preset's learner hands DeepSpeed: every computing option explicit."""
    from hpc_tba.plan.planner import micro_batch_of
    from hpc_tba.roles.learner import deepspeed_config

    cfg = _cfg("+experiment=tba_70b")
    ds = deepspeed_config(cfg.learner, micro_batch=micro_batch_of(cfg), train=True)
    assert ds["gradient_clipping"] == 0.0 and ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 100_000
    assert ds["bf16"]["enabled"] is True and ds["fp16"] == {"enabled": False}
    assert ds["data_types"] == {"param_dtype": "bf16", "grad_accum_dtype": "fp32",
                                "keep_in_fp32_modules": "auto"}
    assert (ds["communication_data_type"], ds["gradient_allreduce_op"]) == ("bf16", "mean")
    assert _cfg().learner.param_persistence_threshold == 0  # the embedded tiny model


def test_bf16_without_zero_is_refused():
    from hpc_tba.config import LearnerConfig
    from hpc_tba.roles.learner import deepspeed_config

    with pytest.raises(ValueError, match="learner.dtype=bf16 needs learner.zero_stage 1-3"):
        deepspeed_config(LearnerConfig(dtype="bf16", zero_stage=0), micro_batch=1, train=True)


# ---------------------------------------------------------------- vLLM
def test_vllm_engine_runs_with_the_configured_settings():
    """One tiny in-process engine (the default searcher config): vLLM's resolved config and the
    sampling parameters of every kind of request read back against the config."""
    from hpc_tba.assembly.engines import build_engine
    from hpc_tba.engine.vllm_engine import NEUTRAL_SAMPLING
    from hpc_tba.tasks.embedded import resolve_model_path

    cfg = _cfg()
    s = cfg.searcher
    engine = build_engine(cfg, resolve_model_path(cfg.model, cfg.task), seed=s.seed + 3, device="cpu")
    seen = []
    try:
        vc = engine.llm.llm_engine.vllm_config
        m, c = vc.model_config, vc.cache_config
        assert (str(m.dtype), m.seed, m.max_model_len) == ("torch.float32", s.seed + 3, s.max_model_len)
        assert (m.logprobs_mode, m.generation_config, m.use_fp64_gumbel) == ("processed_logprobs", "vllm", False)
        assert m.get_diff_sampling_param() == {}  # nothing from the model's generation_config.json
        assert (c.cache_dtype, c.enable_prefix_caching) == ("auto", True)
        assert c.kv_cache_memory_bytes == s.kv_cache_mb * 2**20 and vc.watermark_config is None
        import torch._dynamo  # eager on CPU (enforce_eager=None): nothing compiled, vLLM's helpers neither

        assert vc.model_config.enforce_eager and torch._dynamo.config.disable
        generate = engine.llm.generate
        engine.llm.generate = lambda prompts, params, **kw: seen.append(params) or generate(prompts, params, **kw)
        prompt = engine.tokenize(["1+2="])[0]
        engine.sample([prompt], n=2, temperature=s.temperature, max_tokens=2)
        engine.greedy([prompt], max_tokens=2)
        engine.score(prompt, [5, 6], temperature=1.0)
    finally:
        engine.close()
    assert len(seen) == 3
    for p in seen:
        assert {k: getattr(p, k) for k in NEUTRAL_SAMPLING} == NEUTRAL_SAMPLING
    assert NEUTRAL_SAMPLING["top_k"] == 0 and NEUTRAL_SAMPLING["repetition_penalty"] == 1.0
    assert seen[0].temperature == s.temperature and seen[1].temperature == 0.0


# ---------------------------------------------------------------- GPU placement before MPI
# A rank's entry with an import hook standing in for mpi4py: it records what CUDA_VISIBLE_DEVICES
# was when MPI was first imported (a CUDA-aware MPI initialises CUDA in MPI_Init), and what MPI
# says the rank is comes from FAKE_MPI_RANK. The role itself is not built (run_rank replaced).
_ENTRY = r'''
import importlib.abc, importlib.machinery, json, os, sys, types
seen = {"mpi_imports": 0}

class FakeMPI(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name in ("mpi4py", "mpi4py.MPI"):
            return importlib.machinery.ModuleSpec(name, self, is_package=name == "mpi4py")
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        if module.__name__ == "mpi4py":
            seen["mpi_imports"] += 1
            seen["cuda_visible_at_mpi_import"] = os.environ.get("CUDA_VISIBLE_DEVICES")
            return
        world = types.SimpleNamespace(Get_rank=lambda: int(os.environ["FAKE_MPI_RANK"]),
                                      Get_size=lambda: 80, Abort=lambda code: None)
        module.COMM_WORLD, module.Is_initialized = world, lambda: True

sys.meta_path.insert(0, FakeMPI())
import hpc_tba.cli.rank as run
from hpc_tba.comm.groups import local_device_index
from hpc_tba.config.topology import Topology

def run_rank(cfg):
    rank = int(os.environ["FAKE_MPI_RANK"])
    seen["local_rank"] = local_device_index(Topology.for_run(cfg), rank)  # the learner's LOCAL_RANK
    return rank, None

run.run_rank = run_rank
seen["exit"] = run.main(sys.argv[2:])
seen["cuda_visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")
with open(sys.argv[1], "w") as f:
    json.dump(seen, f)
'''
LAUNCHER_VARS = ("SLURM", "OMPI_", "PMI", "PALS_", "MPI_LOCALRANKID", "CUDA_VISIBLE_DEVICES")
# learner rank 5 of the 70B preset: node 0 (8 learners a node), its 6th task, GPU 5
SLURM_RANK5 = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "g[01-16]", "SLURMD_NODENAME": "g01",
               "SLURM_NODEID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "5", "SLURM_NTASKS": "80"}


def test_gpus_are_placed_before_mpi_is_imported(tmp_path):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    env.update(SLURM_RANK5, FAKE_MPI_RANK="5")
    out = tmp_path / "seen.json"
    proc = subprocess.run([sys.executable, "-c", _ENTRY, str(out), "+experiment=tba_70b",
                           f"run_dir={tmp_path}/run"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(out.read_text())
    assert seen["exit"] == 0 and seen["mpi_imports"] == 1
    assert seen["cuda_visible_at_mpi_import"] == "5"  # placed before MPI_Init could touch CUDA
    assert seen["cuda_visible"] == "5" and seen["local_rank"] == 0  # cuda:0 of "5" = GPU 5


@pytest.mark.parametrize("launcher", [
    {"SLURM_PROCID": "13", "SLURM_LOCALID": "5", "SLURM_NTASKS": "80"},
    {"OMPI_COMM_WORLD_RANK": "13", "OMPI_COMM_WORLD_LOCAL_RANK": "5", "OMPI_COMM_WORLD_SIZE": "80"},
    {"PMI_RANK": "13", "MPI_LOCALRANKID": "5", "PMI_SIZE": "80"},  # MPICH / Hydra, Intel MPI
], ids=["srun", "openmpi", "mpich"])
def test_placement_reads_each_launchers_rank(launcher):
    """Learner rank 13 of the 70B layout: node 1, task 5, GPU 5; the learner's LOCAL_RANK is 0."""
    from hpc_tba.assembly.rank import check_placed_rank, place_devices
    from hpc_tba.comm.groups import local_device_index
    from hpc_tba.config.topology import LayoutError, Topology

    cfg = _cfg("+experiment=tba_70b")
    env = dict(launcher)
    assert place_devices(cfg, env) == 13 and env["CUDA_VISIBLE_DEVICES"] == "5"
    assert local_device_index(Topology.for_run(cfg), 13, env) == 0
    check_placed_rank(13, 13)
    with pytest.raises(LayoutError, match="GPU.s. of rank 13 before MPI started.*MPI says it is rank 12"):
        check_placed_rank(13, 12, env)
    wrong_slot = {k: ("4" if "LOCAL" in k else v) for k, v in launcher.items()}
    with pytest.raises(LayoutError, match="is task 4 of its node.*the layout makes it task 5"):
        place_devices(cfg, wrong_slot)
    assert place_devices(_cfg(), {}) is None  # no GPUs in the cluster: nothing placed


def test_a_searcher_engine_gets_its_tp_group():
    from hpc_tba.assembly.rank import place_devices

    env = {"SLURM_PROCID": "65", "SLURM_LOCALID": "1", "SLURM_NTASKS": "80"}
    assert place_devices(_cfg("+experiment=tba_70b"), env) == 65
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


# ---------------------------------------------------------------- Slurm CPUs per role
def test_a_tp4_searcher_task_gets_cpus_for_its_processes():
    """70B preset: a searcher task runs the searcher (8 threads), the engine core and 4 TP
    workers (1 thread each): 13 CPUs; one srun step gives every task that, learners included."""
    from hpc_tba.cli import sbatch
    from hpc_tba.config.topology import LayoutError

    cfg = _cfg("+experiment=tba_70b")
    assert sbatch.role_cpus(cfg) == {"learner": 8, "searcher": 8 + (1 + 4) * 1}
    assert sbatch.cpus_per_task(cfg) == 13 and "--cpus-per-task=13" in sbatch.srun_command(cfg, [])
    assert sbatch.role_cpus(_cfg("+experiment=tba_70b", "cluster.engine_threads=2"))["searcher"] == 18
    assert sbatch.cpus_per_task(_cfg("+experiment=tba_8b")) == 8  # TP 1, in-process engine
    assert sbatch.cpus_per_task(_cfg("+experiment=tba_70b", "cluster.cpus_per_node=104")) == 13
    with pytest.raises(LayoutError, match="8 tasks x 13 CPUs.*exceed cluster.cpus_per_node=96"):
        sbatch.cpus_per_task(_cfg("+experiment=tba_70b", "cluster.cpus_per_node=96"))
    text = sbatch.sbatch_script(cfg, ["+experiment=tba_70b"], name="x")
    assert 'export OMP_NUM_THREADS="8"' in text and "#SBATCH --cpus-per-task=13" in text


def test_engine_processes_start_with_their_own_threads(monkeypatch):
    """build_engine gives an out-of-process engine's processes cluster.engine_threads threads
    (they inherit the environment when vLLM starts them, inside VLLMEngine)."""
    import os

    from hpc_tba.assembly import engines
    from hpc_tba.engine import vllm_engine

    seen = {}

    class Stub:
        def __init__(self, *a, **kw):
            seen.update(omp=os.environ.get("OMP_NUM_THREADS"), mkl=os.environ.get("MKL_NUM_THREADS"))

    monkeypatch.setattr(vllm_engine, "VLLMEngine", Stub)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.setenv("MKL_NUM_THREADS", "8")
    engines.build_engine(_cfg("+experiment=tba_70b", "cluster.engine_threads=2"), "/m", seed=0, device="cuda")
    assert seen == {"omp": "2", "mkl": "2"}
