"""The objectives a run can train with: each declares its config, what it needs, how it computes.

An objective is one module that subclasses AlgoConfig with its own fields (validated in
`__post_init__`) and calls `register(Objective(...))` at import, plus one `configs/algo/<name>.yaml`.
Built-ins live in hpc_tba/losses/objectives/ and are imported on first use; a plugin names its
module in `algo.module` (the yaml sets it), and composition imports it. Everyone who depends on
the objective asks here instead of testing its name: the dispatcher (compute_loss, loss_units,
group_coupled), the learner (reference model, advantages), the micro-batch planner (context
pass), the memory planner (reference row) and the offline preprocessor (fields a file must carry).

This module and the declaration modules import no torch: composing a config (and failing on a
bad command line) must not pay for it. `compute` and `units` import the tensor math when called.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from hpc_tba.config import AlgoConfig


def _builtin() -> tuple[str, ...]:
    import pkgutil

    from hpc_tba.losses import objectives

    return tuple(sorted(m.name for m in pkgutil.iter_modules(objectives.__path__)))


BUILTIN = _builtin()
"""Built-in objectives: the modules of hpc_tba/losses/objectives/ (`<name>.py` registers `name`)."""


@dataclasses.dataclass(frozen=True)
class Needs:
    """What one configured objective needs besides the policy's log-probs, mask, rewards, groups."""

    reference: bool = False
    """log-probs under the frozen reference policy π_ref (the learner holds a second model)."""
    advantages: bool = False
    """a precomputed advantage per sample (offline: the file's `advantage`; online the learner
    uses R − the group's mean reward)."""
    behavior_logp: bool = False
    """the loss reads log μ of the behaviour policy (offline rows must carry `logp_behavior`)."""
    group_coupled: bool = False
    """one sample's gradient depends on the CURRENT log-probs of other samples of its group, so a
    micro-batch split that cuts a group needs a no-grad context pass (hpc_tba.roles.microbatch)."""


@dataclasses.dataclass(frozen=True)
class Objective:
    """One registered objective."""

    name: str
    """The value of algo.name that selects it."""
    config: type[AlgoConfig]
    """Its config class (a dataclass subclassing AlgoConfig)."""
    compute: Callable[..., Any]
    """compute(cfg, inputs: LossInputs, *, step, normalizer) -> (loss, metrics) (losses/common.py
    conventions: Σ per-unit loss / normalizer, detached 0-dim metrics, `loss/<name>` among them)."""
    needs: Callable[[Any], Needs] = lambda cfg: Needs()
    """needs(cfg) -> Needs for this configuration (variants may need less)."""
    units: Callable[..., Any] | None = None
    """units(cfg, inputs) -> 0-dim tensor of loss units (e.g. DPO's pairs); None: non-empty rows."""
    check_run: Callable[[Any], None] | None = None
    """check_run(cfg) raises ValueError for settings the loss computes but a run cannot train
    (TB's learned logZ: no learner owns one); called at composition."""


_REGISTRY: dict[str, Objective] = {}


def register(objective: Objective) -> Objective:
    """Add an objective (called by its module at import); a name is registered once."""
    if not (isinstance(objective.config, type) and issubclass(objective.config, AlgoConfig)
            and dataclasses.is_dataclass(objective.config)):
        raise TypeError(f"objective {objective.name!r}: config must be a dataclass subclassing AlgoConfig")
    where = f"{objective.config.__module__}.{objective.config.__qualname__}"
    if objective.name in BUILTIN and not where.startswith(f"hpc_tba.losses.objectives.{objective.name}."):
        raise ValueError(f"objective {objective.name!r} is already registered: it is built in "
                         f"(hpc_tba/losses/objectives/{objective.name}.py), not {where}")
    old = _REGISTRY.get(objective.name)
    if old is not None and f"{old.config.__module__}.{old.config.__qualname__}" != where:
        raise ValueError(f"objective {objective.name!r} is already registered by {old.config.__module__}")
    _REGISTRY[objective.name] = objective
    return objective


def objective(name: str, module: str = "") -> Objective:
    """The objective registered as `name`, importing its module first (built-in or `module`)."""
    if name not in _REGISTRY:
        where = module or (f"hpc_tba.losses.objectives.{name}" if name in BUILTIN else "")
        if where:
            try:
                importlib.import_module(where)
            except ModuleNotFoundError as e:
                if e.name is None or not where.startswith(e.name):
                    raise
                raise ValueError(f"algo.module={where!r} (for algo.name={name!r}) cannot be imported: "
                                 f"{e}") from None
    if name not in _REGISTRY:
        raise ValueError(f"algo.name={name!r} is not one of {', '.join(BUILTIN)}"
                         + (f" nor registered by algo.module={module!r}" if module else
                            " (a plugin objective names its module in algo.module)"))
    return _REGISTRY[name]


def objective_of(cfg: AlgoConfig) -> Objective:
    """The objective `cfg` configures; refuses a config of another objective's class."""
    obj = objective(cfg.name, cfg.module)
    if not isinstance(cfg, obj.config):
        raise TypeError(f"algo.name={cfg.name!r} needs a {obj.config.__name__}, got {type(cfg).__name__} "
                        "(build objective configs with hpc_tba.losses.registry.make_config)")
    return obj


def needs(cfg: AlgoConfig) -> Needs:
    """What this configured objective needs (see Needs)."""
    return objective_of(cfg).needs(cfg)


def config_class(name: str, module: str = "") -> type[AlgoConfig]:
    """The config class of objective `name` (composition validates the algo node against it)."""
    return objective(name, module).config


def make_config(name: str = "tb", module: str = "", **fields: Any) -> AlgoConfig:
    """The config of objective `name` with `fields` set (the rest at their defaults); a field
    the objective does not declare is refused by name."""
    cls = config_class(name, module)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown config key {'algo.' + unknown[0]!r}: algo={name} declares "
                         f"{', '.join(sorted(known - {'name', 'module'}))}")
    return cls(name=name, module=module, **fields)


def need(inputs: Any, field: str, cfg: AlgoConfig):
    """`inputs.<field>`, or a ValueError naming the objective when it is None."""
    value = getattr(inputs, field)
    if value is None:
        raise ValueError(f"algo={cfg.name} (variant settings as configured) needs LossInputs.{field}; got None")
    return value
