"""Every numeric setting declares its range (hpc_tba.config.ranges) and a value outside it is refused
in one line naming the key, the value and the range, at composition: before any rank starts.

The classes walked are the config package's and every built-in objective's (hpc_tba.losses.registry,
plus the test plugin's), so a new class or a new numeric field is covered without editing this file;
a numeric field without a range fails test_every_numeric_field_declares_a_range unless UNRANGED
names it.
"""
from __future__ import annotations

import dataclasses
import math
import subprocess
import types
import typing

import pytest
from conftest import HPC_TBA

import hpc_tba.config as config_pkg
from hpc_tba.config import AlgoConfig, LearnerConfig, Range, RunConfig, range_of, ranged
from hpc_tba.losses.registry import BUILTIN, config_class

UNRANGED: frozenset[str] = frozenset()
"""`Class.field` of numeric fields that take any value, NaN and ±inf included; none today (seeds
are >= 0: numpy's generators refuse negative ones). Keep it short: a field here is unchecked."""


def _classes() -> list[type]:
    plugin = config_class("clipped_pg", "plugins.clipped_pg_loss")  # tests/ is on sys.path
    own = [getattr(config_pkg, n) for n in config_pkg.__all__]
    own = [c for c in own if isinstance(c, type) and dataclasses.is_dataclass(c) and c is not Range]
    return [*own, *(config_class(name) for name in BUILTIN), plugin]


CLASSES = _classes()
_SECTIONS = {typing.get_type_hints(RunConfig)[f.name]: f.name for f in dataclasses.fields(RunConfig)}


def _section(cls: type) -> str:
    """The key prefix of cls's fields: its field name in RunConfig (`algo` for every objective)."""
    return "algo" if issubclass(cls, AlgoConfig) else "" if cls is RunConfig else _SECTIONS[cls]


def _kind(hint) -> type | None:
    """int or float for a numeric field's type (`int`, `float | None`), else None (bool is not numeric)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    kinds = [a for a in args if a in (int, float)]
    return kinds[0] if kinds else None


def _ranged_fields() -> list[tuple[type, str, type, Range]]:
    out = []
    for cls in CLASSES:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            rng = range_of(f)
            if rng is not None:
                out.append((cls, f.name, _kind(hints[f.name]), rng))
    return out


RANGED = _ranged_fields()


def _outside(rng: Range, kind: type) -> list:
    """Values just outside `rng` for a field of type `kind`: below a closed low, the open bound
    itself, above a closed high; ±inf where an infinite bound is open; NaN for floats."""
    values = []
    for bound, is_open, step in ((rng.low, rng.low_open, -1), (rng.high, rng.high_open, 1)):
        if math.isfinite(bound):
            values.append(kind(bound) if is_open else kind(bound) + step)
        elif is_open and kind is float:
            values.append(bound)
    return values + ([math.nan] if kind is float else [])


def test_the_walk_covers_every_config_and_objective():
    names = {c.__name__ for c in CLASSES}
    assert {"ModelConfig", "TaskConfig", "BufferConfig", "LearnerConfig", "SearcherConfig", "ClusterConfig",
            "RunConfig", "AlgoConfig", "TBConfig", "ToprConfig", "AlolConfig", "GrpoConfig", "RlooConfig",
            "DpoConfig", "SftConfig", "ClippedPGConfig"} <= names
    assert len(RANGED) > 60


@pytest.mark.parametrize("cls, name, kind, rng", RANGED, ids=[f"{c.__name__}.{n}" for c, n, _, _ in RANGED])
def test_an_out_of_range_value_is_refused_naming_key_value_and_range(cls, name, kind, rng):
    assert kind is not None, f"{cls.__name__}.{name} declares a range but is not int or float"
    default = getattr(cls(), name)
    assert default in rng, f"{cls.__name__}.{name}: the default {default!r} is outside its range ({rng})"
    key = f"{_section(cls)}.{name}"
    values = _outside(rng, kind)
    assert values, f"{key}: {rng} leaves no value outside it to try"
    for value in values:
        with pytest.raises(ValueError) as e:
            cls(**{name: value})
        msg = str(e.value)
        assert f"{key}={value!r} is out of range: {rng}" in msg, msg
        assert "\n" not in msg


def test_every_numeric_field_declares_a_range():
    unranged = set()
    for cls in CLASSES:
        hints = typing.get_type_hints(cls)
        unranged |= {f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls)
                     if _kind(hints[f.name]) is not None and range_of(f) is None}
    assert unranged == set(UNRANGED), ("numeric fields without a range: declare one with "
                                       f"hpc_tba.config.ranged(), or add them to UNRANGED: {sorted(unranged)}")


def test_several_bad_values_are_refused_together_in_one_line():
    with pytest.raises(ValueError) as e:
        LearnerConfig(lr=-1.0, log_every=0, eval_every=-1)
    assert str(e.value) == ("learner.lr=-1.0 is out of range: must be > 0; "
                            "learner.eval_every=-1 is out of range: must be >= 0 (0: only before and after); "
                            "learner.log_every=0 is out of range: must be >= 1")


@pytest.mark.parametrize("bounds, text, inside, outside", [
    ({"gt": 0}, "must be > 0", [1e-9, 5], [0, -1.0, math.inf, math.nan]),
    ({"ge": 1}, "must be >= 1", [1, 10**9], [0, 0.5]),
    ({"ge": 0, "lt": 1}, "must be in [0, 1)", [0, 0.999], [1.0, -0.1]),
    ({"gt": 0, "le": 1}, "must be in (0, 1]", [1.0, 0.5], [0.0, 1.5]),
    ({"ge": 0, "le": math.inf}, "must be in [0, inf]", [0, math.inf], [-1, math.nan]),
    ({}, "must be a number", [-1e30, 0, 3], [math.inf, -math.inf, math.nan]),
])
def test_a_range_says_what_it_takes(bounds, text, inside, outside):
    rng = range_of(ranged(0, **bounds))
    assert str(rng) == text
    assert all(v in rng for v in inside) and not any(v in rng for v in outside)
    assert True not in rng and "1" not in rng  # booleans and strings are no numbers


def _cli(*args: str):
    proc = subprocess.run([HPC_TBA, *args], capture_output=True, text=True, timeout=120)
    return proc, [line for line in proc.stderr.splitlines() if line.strip()]


def test_train_refuses_a_bad_learning_rate_before_any_rank_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc, lines = _cli("train", "learner.lr=-1", f"run_dir={run_dir}")
    assert proc.returncode == 2
    assert lines == ["hpc-tba: bad configuration: learner.lr=-1.0 is out of range: must be > 0"], lines
    # the launcher writes run_dir (its log, the embedded model's build) before it starts a rank
    assert not run_dir.exists() and not proc.stdout


def test_plan_refuses_a_bad_learning_rate():
    proc, lines = _cli("plan", "+experiment=tba_70b", "learner.lr=0")
    assert proc.returncode == 2
    assert len(lines) == 1 and "learner.lr=0.0 is out of range: must be > 0" in lines[0], lines
    assert not proc.stdout  # no plan printed
