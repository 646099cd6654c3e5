"""The engine interface: what a searcher and `hpc-tba eval` ask of a generation engine.

`VLLMEngine` (engine/vllm_engine.py) is the implementation the runs use; a second engine is one
module with a class that has these members (structural typing: no base class to inherit), plus
its case in hpc_tba/assembly/engines.py `build_engine`. tests/test_engine_protocol.py drives the
real Searcher for a round with a small pure-Python engine.

Token ids in, token ids out: prompts are tokenized once by the engine's own tokenizer, and the
behaviour log-probs of a sample are those of the distribution its tokens were drawn from,
log_softmax(logits / temperature), which the learner recomputes the same way.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Sample:
    """One generated response."""

    tokens: np.ndarray  # [T] int32
    logp: np.ndarray  # [T] float32, log-probs of the sampled tokens under logits / temperature
    versions: np.ndarray | None = None  # [T] int64 version that produced each token (in flight)


@runtime_checkable
class Engine(Protocol):
    """A generation engine owned by one searcher (or by `hpc-tba eval`)."""

    version: int
    """Policy version of the weights it holds (0: the starting weights)."""
    updates_in_flight: int
    """Versions applied while requests were running (searcher.update=in_flight)."""

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (with the tokenizer's special tokens, as the learner sees them)."""
        ...

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of a response's token ids (special tokens dropped)."""
        ...

    def prompt_fits(self, prompt: Sequence[int]) -> bool:
        """Whether a prompt leaves room for searcher.max_new_tokens within max_model_len."""
        ...

    def sample(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float,
               max_tokens: int, seed: int | None = None,
               weights_ready: Callable[[], bool] | None = None,
               apply: Callable[[], None] | None = None) -> list[list[Sample]]:
        """n samples per prompt with their per-token log-probs. With `weights_ready` and `apply`
        the engine may load new weights between decode steps (`apply()` does it) and stamps
        every token with its version (Sample.versions)."""
        ...

    def greedy(self, prompts: Sequence[Sequence[int]], *, max_tokens: int) -> list[list[int]]:
        """One greedy (temperature 0) response per prompt, as token ids."""
        ...

    def score(self, prompt: Sequence[int], response: Sequence[int], *, temperature: float) -> np.ndarray:
        """[len(response)] float32 log-probs of `response` after `prompt` (the sync probe)."""
        ...

    def load_weights(self, named_tensors: list[tuple[str, Any]], version: int) -> None:
        """Replace the weights in place (Hugging Face names, torch tensors) and adopt `version`;
        a version lower than the current one is an error."""
        ...

    def close(self) -> None:
        """Release the engine (its memory, processes)."""
        ...
