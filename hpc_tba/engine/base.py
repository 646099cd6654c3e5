"""The engine interface: what a searcher and `hpc-tba eval` ask of a generation engine.

`VLLMEngine` (engine/vllm_engine.py) is the implementation the runs use; a second engine is one
module with a class that has these members (structural typing: no base class to inherit), plus
its case in hpc_tba/assembly/engines.py `build_engine`. tests/test_engine_protocol.py drives the
real Searcher for a round, and for continuous generation, with a small pure-Python engine.

Token ids in, token ids out: prompts are tokenized once by the engine's own tokenizer, and the
behaviour log-probs of a sample are those of the distribution its tokens were drawn from,
log_softmax(logits / temperature), which the learner recomputes the same way.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Sample:
    """One generated response."""

    tokens: np.ndarray  # [T] int32
    logp: np.ndarray  # [T] float32, log-probs of the sampled tokens under logits / temperature
    versions: np.ndarray | None = None  # [T] int64 version that produced each token (in flight)


@dataclasses.dataclass(frozen=True)
class Group:
    """The samples of one prompt, yielded by `Engine.generate` once all n have finished."""

    key: Any  # what the prompt source gave with the prompt (the searcher: the prompt's slice index)
    samples: list[Sample]  # the finished samples, in request order (n minus the dropped ones)
    dropped: int = 0  # samples given up because they would span more than max_version_span versions


PromptSource = Callable[[], "tuple[Any, Sequence[int]] | None"]
"""Called when the engine has room for one more group: (key, prompt token ids), or None when
nothing is to be admitted now (no prompt, back-pressure, stopping)."""


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

    def generate(self, next_prompt: PromptSource, *, n: int, temperature: float, max_tokens: int,
                 capacity: int, weights_ready: Callable[[], bool] | None = None,
                 apply: Callable[[], None] | None = None,
                 max_version_span: int = 0) -> Iterator[Group]:
        """Continuous generation: keep up to `capacity` groups (n samples of one prompt) running,
        admitting the next prompt from `next_prompt` whenever a group finishes, and yield each
        group as soon as all its samples have finished. With `weights_ready`/`apply` new weights
        are applied between decode steps as in `sample` (every token stamped with its version;
        `apply()` is called with no request running, so it may also use `greedy`), and a running
        sample that already holds `max_version_span` versions (> 0) is given up rather than
        continued on a new one (counted in Group.dropped). Returns once nothing runs and
        `next_prompt` gives None; a generator closed early aborts what is still running."""
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
