"""Numeric ranges of config fields, declared where the field is and checked in one place.

A ranged field carries its Range in the dataclass field's metadata; `ranged()` declares it:

    lr: float = ranged(1e-5, gt=0)
    \"\"\"Adam learning rate ...\"\"\"

and every config's `__post_init__` calls `check_ranges(self, "learner")` first, which refuses
all out-of-range fields of the instance in one line (`learner.lr=-1.0 is out of range: must be
> 0`), so a bad value stops composition before any rank starts (hpc_tba.assembly.compose turns
the ValueError into a ConfigError). Checks across fields and choices among names stay in the
`__post_init__`s. An infinite bound is part of the range only where it is closed: `ranged(x,
ge=0)` is [0, inf) and refuses inf (and NaN, which is in no range), `ranged(x, ge=0, le=inf)`
takes inf as a value.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

RANGE_KEY = "range"
"""The key of a field's metadata that holds its Range."""
SEED_NOTE = "numpy's random generators take no negative seed"
"""The note of every seed's range (seeds reach np.random.default_rng)."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: an interval with open or closed ends."""

    low: float = -math.inf
    """Lower bound (-inf: none)."""
    high: float = math.inf
    """Upper bound (inf: none)."""
    low_open: bool = False
    """The lower bound itself is outside the range (> low rather than >= low)."""
    high_open: bool = False
    """The upper bound itself is outside the range (< high rather than <= high)."""
    note: str = ""
    """Why, or what a bound value means, added to the refusal (e.g. `0: unbounded`)."""

    def __post_init__(self) -> None:
        if math.isnan(self.low) or math.isnan(self.high) or not self.low <= self.high:
            raise ValueError(f"Range({self.low}, {self.high}): the bounds must be numbers, low <= high")

    def __contains__(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        """`must be > 0`, `must be >= 1`, `must be in [0, 1)`: what a refusal says."""
        finite_low, finite_high = math.isfinite(self.low), math.isfinite(self.high)
        infinity_taken = (not finite_low and not self.low_open) or (not finite_high and not self.high_open)
        if finite_low and finite_high or infinity_taken:
            return (f"must be in {'(' if self.low_open else '['}{_num(self.low)}, "
                    f"{_num(self.high)}{')' if self.high_open else ']'}")
        if finite_low:
            return f"must be {'>' if self.low_open else '>='} {_num(self.low)}"
        if finite_high:
            return f"must be {'<' if self.high_open else '<='} {_num(self.high)}"
        return "must be a number"


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) else str(x)


def ranged(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, note: str = "") -> Any:
    """A dataclass field with `default` whose values must lie in the range the bounds give:
    ge/gt a closed/open lower bound, le/lt a closed/open upper one (none: unbounded, finite)."""
    if ge is not None and gt is not None or le is not None and lt is not None:
        raise TypeError("ranged(): give at most one lower bound (ge or gt) and one upper bound (le or lt)")
    low, high = (ge if gt is None else gt), (le if lt is None else lt)
    rng = Range(low=-math.inf if low is None else float(low), high=math.inf if high is None else float(high),
                low_open=low is None or gt is not None, high_open=high is None or lt is not None, note=note)
    return dataclasses.field(default=default, metadata={RANGE_KEY: rng})


def range_of(field: dataclasses.Field) -> Range | None:
    """The Range a dataclass field declares, or None."""
    return field.metadata.get(RANGE_KEY)


def refusal(key: str, value: Any, rng: Range) -> str:
    """What a user is told about `key=value` outside `rng`, e.g. `learner.lr=-1.0 is out of
    range: must be > 0`."""
    why = str(rng)
    if isinstance(value, float) and math.isinf(value):
        why += " and finite"
    return f"{key}={value!r} is out of range: {why}" + (f" ({rng.note})" if rng.note else "")


def check_ranges(cfg: Any, section: str) -> None:
    """Raise one ValueError, one line, naming every ranged field of the dataclass instance `cfg`
    whose value is outside its Range; keys are prefixed with `section.` (none when empty)."""
    prefix = f"{section}." if section else ""
    bad = [refusal(prefix + f.name, getattr(cfg, f.name), rng) for f in dataclasses.fields(cfg)
           if (rng := range_of(f)) is not None and getattr(cfg, f.name) not in rng]
    if bad:
        raise ValueError("; ".join(bad))
