"""One interface over vLLM for the searchers: sample n per prompt with per-token log-probs,
greedy decoding for evaluation, in-place weight updates, and a policy version.

Why `logprobs_mode="processed_logprobs"`: the behaviour log-probs must be those of the
distribution the tokens were actually drawn from, i.e. log_softmax(logits / T). The learner
computes its log-probs from logits / T as well (ALGORITHMS.md §1), so both sides agree.

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so MPI stays in the searcher's main
process and weight updates are a direct call. On CPU, in-place updates go through the worker's
`reload_weights` (vLLM's layer-wise reload; plain `load_weights` fails on the CPU build); the
prefix cache is reset after each update so no KV computed with old weights is reused.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np
import torch

from hpc_tba.roles.config import SearcherConfig


@dataclasses.dataclass(frozen=True)
class Sample:
    """One generated response."""

    tokens: np.ndarray  # [T] int32
    logp: np.ndarray  # [T] float32, log-probs of the sampled tokens under logits / temperature


def configure_cpu_env(*, core: int | None, kv_cache_mb: int) -> None:
    """Environment vLLM reads at import: in-process engine, pinned threads, bounded KV cache."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if core is None else str(core))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, kv_cache_mb // 1024)))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class VLLMEngine:
    """A vLLM engine owned by one searcher."""

    def __init__(self, model_path: str, cfg: SearcherConfig, *, seed: int, device: str = "cpu"):
        from vllm import LLM

        self.cfg = cfg
        self.version = 0
        kwargs = dict(model=model_path, dtype=cfg.dtype, seed=seed, max_model_len=cfg.max_model_len,
                      enforce_eager=True, logprobs_mode="processed_logprobs",
                      enable_prefix_caching=True, tensor_parallel_size=cfg.tensor_parallel_size)
        if device == "cpu":
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_mb * 2**20
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        self.llm = LLM(**kwargs)
        self.eos_token_id = self.llm.get_tokenizer().eos_token_id

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        tok = self.llm.get_tokenizer()
        return [tok(t)["input_ids"] for t in texts]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.llm.get_tokenizer().decode(list(tokens), skip_special_tokens=True)

    def sample(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float,
               max_tokens: int, seed: int | None = None) -> list[list[Sample]]:
        """n samples for each prompt (token ids), each with its per-token log-probs."""
        from vllm import SamplingParams

        params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0,
                                seed=seed)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                 use_tqdm=False)
        return [[self._sample(c) for c in o.outputs] for o in outs]

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                 use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def score(self, prompt: Sequence[int], response: Sequence[int], *, temperature: float) -> np.ndarray:
        """Per-token log-probs of `response` after `prompt` under the engine (a probe for sync checks).

        Uses prompt log-probs of the concatenation; divided by T explicitly because vLLM's prompt
        log-probs are not temperature-processed.
        """
        from vllm import SamplingParams

        ids = list(prompt) + list(response)
        params = SamplingParams(n=1, temperature=temperature, max_tokens=1, prompt_logprobs=0)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        lps = out.prompt_logprobs[len(prompt):]
        return np.array([lp[t].logprob for lp, t in zip(lps, response)], dtype=np.float32)

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the weights in place (Hugging Face names) and adopt `version`."""
        if version < self.version:
            raise ValueError(f"weight version went backwards: {self.version} -> {version}")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        self.llm.reset_prefix_cache()
        self.version = version

    def _sample(self, completion) -> Sample:
        tokens = np.asarray(completion.token_ids, dtype=np.int32)
        logp = np.array([step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)],
                        dtype=np.float32)
        return Sample(tokens, logp)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        del llm
