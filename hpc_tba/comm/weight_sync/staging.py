"""Weight staging of a searcher: the staging modes (`searcher.staging`: device, host, stream), the
memory each one takes (`staging_bytes`, which the planner counts), and the forms a received version
is handed to the searcher in (`StagedWeights`, `StreamedWeights`). receiver.py's `WeightReceiver`
fills them."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from hpc_tba.comm.weight_sync.manifest import Manifest


@dataclasses.dataclass
class StagedWeights:
    version: int
    flags: int
    tensors: list[tuple[str, torch.Tensor]]
    """(name, tensor in the wire dtype): views into the receiver's one version buffer; read them
    inside `WeightReceiver.reading()` (the next version overwrites the buffer)."""


@dataclasses.dataclass
class StreamedWeights:
    """A version whose buckets are still arriving (staging=stream): iterate `tensors()` once,
    straight into the engine; each bucket is received while the one before it is loaded."""

    version: int
    flags: int
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]


STAGING_MODES = ("device", "host", "stream")


def staging_bytes(manifest: Manifest, staging: str) -> int:
    """The searcher's sync memory (bytes the receiver allocates at most) for a manifest: device and
    host staging hold one whole version plus one bucket (the bucket an NCCL receive lands in
    before host staging, or a skipped version is drained into); stream holds two buckets, three
    while the loader still references the last tensor of both when it asks for the next (a loop
    variable does; `_consume` then allows one more rather than deadlock)."""
    itemsize = torch.empty((), dtype=manifest.dtype).element_size()
    bucket = manifest.largest_bucket_numel * itemsize
    if staging == "stream":
        return 3 * bucket  # two, and the one more allowed while a loader still holds both
    if staging in ("device", "host"):
        return manifest.total_bytes + bucket
    raise ValueError(f"weight staging {staging!r} is not one of {STAGING_MODES}")


def resolve_staging(staging: str, device: str, manifest: Manifest, *,
                    update: str = "between_rounds") -> str:
    """searcher.staging with `auto` resolved: stream, for every device, manifest and update mode
    (issue 24's rule: no process on a searcher node holds more than a few buckets of a version).
    With in-flight updates the engine takes each version between two decode steps; with
    between-rounds updates a version announced during a round is skipped (drained into one
    bucket, `searcher/versions_skipped`) and the searcher, at the end of the round, waits at most
    one round's time for the next one (docs/SEARCHERS.md). `device`/`host` (a whole version
    waiting in memory, so the next round starts at once) are opt-in."""
    del device, manifest, update  # auto no longer depends on them (kept: the callers' signature)
    if staging == "auto":
        return "stream"
    if staging not in STAGING_MODES:
        raise ValueError(f"searcher.staging={staging!r} is not auto or one of {STAGING_MODES}")
    return staging
