"""The weight-sync protocol both sides agree on: header flags, wire dtypes, and the `Manifest`
(parameter names and shapes in broadcast order, split into buckets; see the package docstring)."""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator

import torch

FLAG_EVAL = 1
"""The searchers should evaluate this version on the held-out split."""
FLAG_STOP = 2
"""No more versions: receivers exit."""

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Dtypes weights may travel in, by the name the manifest's JSON carries."""
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def wire_dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical manifest name of a wire dtype (accepts torch dtypes, `bf16`, `bfloat16`, ...)."""
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in WIRE_DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"weight-sync wire dtype {dtype} is not one of {list(WIRE_DTYPES)}")
        return names[dtype]
    name = _ALIASES.get(dtype, dtype)
    if name not in WIRE_DTYPES:
        raise ValueError(f"weight-sync wire dtype {dtype!r} is not one of {list(WIRE_DTYPES)}")
    return name


WIRE_PIECE_BYTES = 16 << 20
"""Bytes of one broadcast: a bucket travels as consecutive pieces of this size, each sent as soon
as the gather has filled it (tools/bench_weight_sync.py: 16 MiB broadcasts reach 0.9x one flat
broadcast here, and with 256 MiB buckets sent whole the first bucket's gather could not overlap
anything), or larger, so that no bucket takes more than MAX_PIECES broadcasts."""
MAX_PIECES = 8
"""Most broadcasts per bucket (each NCCL collective has a fixed launch cost: a 512 MiB bucket
goes as 8 pieces of 64 MiB, not 32 of 16 MiB); the gather exposed before a bucket's first
piece goes is at most 1/MAX_PIECES of it."""


def piece_elements(piece_bytes: int, itemsize: int, largest_bucket_numel: int) -> int:
    """Elements of one broadcast piece (`Manifest.piece_numel`; the planner counts with it too):
    `piece_bytes`, or more where the largest bucket would otherwise take more than MAX_PIECES."""
    return max(1, piece_bytes // itemsize, -(-largest_bucket_numel // MAX_PIECES))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Parameter names and shapes in broadcast order, grouped into buckets, and the wire dtype."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    buckets: tuple[tuple[int, ...], ...]  # indices into names, in order
    wire_dtype: str = "float32"
    """Name (a key of WIRE_DTYPES) of the dtype every bucket travels in."""
    piece_bytes: int = WIRE_PIECE_BYTES
    """Bytes of one broadcast (`piece_numel`: more where a bucket would take over MAX_PIECES);
    buckets stay the unit of memory."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "wire_dtype", wire_dtype_name(self.wire_dtype))
        order = [i for b in self.buckets for i in b]
        if order != list(range(len(self.names))) or len(self.shapes) != len(self.names):
            raise ValueError("weight manifest buckets must cover every parameter once, in order")
        if self.piece_bytes <= 0:
            raise ValueError(f"weight manifest piece_bytes={self.piece_bytes} must be positive")

    @classmethod
    def build(cls, named_shapes: list[tuple[str, tuple[int, ...]]], *, bucket_bytes: int,
              wire_dtype: torch.dtype | str = torch.float32,
              piece_bytes: int = WIRE_PIECE_BYTES) -> Manifest:
        """Greedy bucketing: a bucket closes before the parameter that would overflow it (a
        parameter larger than `bucket_bytes` gets a bucket of its own)."""
        itemsize = torch.empty((), dtype=WIRE_DTYPES[wire_dtype_name(wire_dtype)]).element_size()
        buckets, current, size = [], [], 0
        for i, (_, shape) in enumerate(named_shapes):
            nbytes = math.prod(shape) * itemsize
            if current and size + nbytes > bucket_bytes:
                buckets.append(tuple(current))
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(tuple(current))
        return cls(tuple(n for n, _ in named_shapes), tuple(tuple(s) for _, s in named_shapes),
                   tuple(buckets), wire_dtype_name(wire_dtype), piece_bytes)

    def to_json(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "buckets": [list(b) for b in self.buckets], "wire_dtype": self.wire_dtype,
                "piece_bytes": self.piece_bytes}

    @classmethod
    def from_json(cls, d: dict) -> Manifest:
        return cls(tuple(d["names"]), tuple(tuple(s) for s in d["shapes"]),
                   tuple(tuple(b) for b in d["buckets"]), d.get("wire_dtype", "float32"),
                   d.get("piece_bytes", WIRE_PIECE_BYTES))

    @property
    def dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.wire_dtype]

    @functools.cached_property
    def piece_numel(self) -> int:
        """Most elements of one broadcast: every bucket travels as consecutive pieces of this many
        elements (the last one shorter), on the sender and every receiver alike: `piece_bytes`,
        or more where the largest bucket would otherwise take more than MAX_PIECES."""
        return piece_elements(self.piece_bytes, self.dtype.itemsize, self.largest_bucket_numel)

    def bucket_numel(self, b: int) -> int:
        return sum(math.prod(self.shapes[i]) for i in self.buckets[b])

    @functools.cached_property
    def largest_bucket_numel(self) -> int:
        """Elements of the largest bucket: what one staging slot or bucket buffer must hold."""
        return max(self.bucket_numel(b) for b in range(len(self.buckets)))

    def bucket_views(self, b: int, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view into `flat`) of every parameter of bucket b, in order; `flat` holds the
        bucket as it travels (its parameters back to back)."""
        off = 0
        for i in self.buckets[b]:
            n = math.prod(self.shapes[i])
            yield self.names[i], flat[off: off + n].view(self.shapes[i])
            off += n

    @functools.cached_property
    def bucket_starts(self) -> tuple[int, ...]:
        """Element offset of each bucket in the concatenation of all buckets (and the total)."""
        starts = [0]
        for b in range(len(self.buckets)):
            starts.append(starts[-1] + self.bucket_numel(b))
        return tuple(starts)

    @property
    def numel(self) -> int:
        return self.bucket_starts[-1]

    @property
    def total_bytes(self) -> int:
        """Bytes of one sync on the wire (header excluded)."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()
