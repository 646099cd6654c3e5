"""One model built at a time in a process: every model hpc_tba builds is built under `building()`.

Building a model changes process-wide state, not the building thread's: DeepSpeed's
`zero.Init` wraps every `torch.nn.Module` subclass's `__init__` and torch's tensor factories
(a module made anywhere in the process meanwhile is partitioned: an engine's embedding came out
with 0 columns), transformers' `no_init_weights` replaces `torch.nn.init`, and both
transformers and vLLM set torch's default dtype while they build. Under mpiexec a process holds
one role and the lock is never contended; in one process (hpc_tba.assembly.inprocess: every
rank a thread) the learner's ZeRO-3 build and the searcher's engine build raced, and the engine's
first weight load failed in about one full suite in three. The same code runs in both.

The lock is re-entrant (a build that builds another, e.g. a task's reward model inside a role's
build, does not deadlock). A build under it must not wait for another thread of this process:
zero.Init's collectives under it are fine because a process holds one learner rank (the
in-process runner refuses two).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCK = threading.RLock()
_HELD = threading.local()


@contextmanager
def building() -> Iterator[None]:
    """Hold the process's model-construction lock while a model is built."""
    with _LOCK:
        _HELD.depth = getattr(_HELD, "depth", 0) + 1
        try:
            yield
        finally:
            _HELD.depth -= 1


def held_here() -> bool:
    """Whether this thread is inside `building()` (for checks and tests)."""
    return getattr(_HELD, "depth", 0) > 0
