"""Hydra composition of a run's configuration, and the checks across its components.

`configs/` holds one yaml group per component (model, algo, task, buffer, learner, searcher,
cluster) plus `experiment/` presets. Every yaml is merged onto its component's dataclass
(hpc_tba.config), so an unknown or mistyped key fails at composition with the key's name, and
each component's `__post_init__` validates values. The objective's dataclass is the one its
registration declares (hpc_tba.losses.registry), picked from `algo.name` (importing
`algo.module` first for a plugin objective). The DictConfig stops at `compose()`: components
receive only their own dataclass.

More config directories: HPC_TBA_CONFIG_PATH, directories separated by `os.pathsep`, is added to
Hydra's search path after `configs/`, so a plugin's `algo/<name>.yaml` there is found by
`algo=<name>` (a name in `configs/` wins). Every rank composes its own config, so the variable
(and a PYTHONPATH that imports the plugin's `algo.module`) must reach the ranks' environment, as
mpiexec and srun pass it on by default.

Then `fit_run` resolves what depends on more than one component, so every entry point (train,
plan, eval, preprocess, tests composing a config) sees the same resolved values and the run's
saved config.yaml records them:

- settings an objective computes but a run cannot train are refused (its registration's
  `check_run`: TB's learned logZ, which no learner owns).
- the reward map: algo.reward_map resolved against the task's declared reward range
  (AlgoConfig.fit_rewards; TOPR's ill-defined positive/negative split is refused).
- an objective that needs advantages (A-LoL, except R-LoL) selects buffer.sampler=advantage
  (A-LoL draws rows ∝ A+) when the buffer is left at TBA's sampler.
- task=offline turns off TBA's recency slots (buffer.recency_m=0): no searcher ever refreshes an
  offline prompt, so every prompt would stay "recent" and recency slots would take each prompt's
  last K rows in file order for the whole run. What is left of TBA's sampler is its priority
  slot: uniform at buffer.inv_temp=0, reward priority above (buffer=tldr).
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path

from hpc_tba.config import (
    AlgoConfig,
    BufferConfig,
    ClusterConfig,
    ConfigError,
    LearnerConfig,
    ModelConfig,
    RunConfig,
    SearcherConfig,
    TaskConfig,
)
from hpc_tba.losses.registry import config_class, needs, objective_of
from hpc_tba.tasks import reward_range

CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "configs"
CONFIG_PATH_ENV = "HPC_TBA_CONFIG_PATH"


def _register() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    # The algo node is untyped for Hydra, holding the fields every objective has (each yaml adds
    # its objective's own); compose() validates it against the class algo.name picks.
    run = OmegaConf.structured(RunConfig)
    cs.store(name="run_schema", node=OmegaConf.create({k: {} if k == "algo" else run[k] for k in run}))
    cs.store(group="algo", name="algo_schema", node=dataclasses.asdict(AlgoConfig()))
    for group, cls in (("model", ModelConfig), ("task", TaskConfig), ("buffer", BufferConfig),
                       ("learner", LearnerConfig), ("searcher", SearcherConfig), ("cluster", ClusterConfig)):
        cs.store(group=group, name=f"{group}_schema", node=cls)


def _searchpath() -> list[str]:
    extra = [d for d in os.environ.get(CONFIG_PATH_ENV, "").split(os.pathsep) if d]
    for d in extra:
        if not os.path.isdir(d):
            raise ConfigError(f"{CONFIG_PATH_ENV}: {d!r} is not a directory")
    return [f"hydra.searchpath=[{','.join('file://' + os.path.abspath(d) for d in extra)}]"] if extra else []


def compose(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Compose `configs/config.yaml` with Hydra overrides into a validated RunConfig.

    Raises ConfigError with a one-line message for unknown keys, bad types and bad values.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = hydra_compose(config_name="config",
                                overrides=[*_searchpath(), *map(_dict_entry, overrides)])
        algo_cls = config_class(str(cfg.algo.get("name", "tb")), str(cfg.algo.get("module", "") or ""))
        _check_keys(cfg, RunConfig, "", algo=algo_cls)
        schema = OmegaConf.structured(RunConfig(algo=algo_cls()))
        obj = OmegaConf.to_object(OmegaConf.merge(schema, cfg))
        assert isinstance(obj, RunConfig) and isinstance(obj.algo, algo_cls)
        fit_run(obj)
    except Exception as e:
        if isinstance(e, ConfigError):
            raise
        if isinstance(e, (OmegaConfBaseException, ValueError, TypeError)) or \
                type(e).__module__.startswith("hydra"):
            raise ConfigError(f"bad configuration: {_one_line(e)}") from None
        raise
    obj.run_dir = os.path.abspath(os.path.expanduser(obj.run_dir))
    return obj


DICT_FIELDS = ("task.columns.",)
"""Dict-valued fields whose entries a plain `task.columns.question=problem` adds or replaces."""


def _dict_entry(override: str) -> str:
    """`task.columns.X=Y` as Hydra's add-or-override `++task.columns.X=Y` (a plain override of a
    key the dict does not hold yet is refused in struct mode; `+` is refused for one it holds)."""
    return "++" + override if override.startswith(DICT_FIELDS) and "=" in override else override


def fit_run(cfg: RunConfig) -> None:
    """Resolve and check the cross-component settings of a RunConfig in place (module docstring)."""
    check = objective_of(cfg.algo).check_run
    if check is not None:
        check(cfg.algo)
    rng = reward_range(cfg.task)
    cfg.algo = cfg.algo.fit_rewards(None if rng is None else (rng.low, rng.high), task=cfg.task.name)
    if needs(cfg.algo).advantages and cfg.buffer.sampler == "tba":
        cfg.buffer = dataclasses.replace(cfg.buffer, sampler="advantage")
    if cfg.task.name == "offline" and cfg.buffer.sampler == "tba" and cfg.buffer.recency_m > 0:
        cfg.buffer = dataclasses.replace(cfg.buffer, recency_m=0.0)


RENAMED = {"cluster.cpu_memory_gb": "cluster.host_memory_gb"}
"""Keys an earlier release had, with their names now (a user's old override gets the new name)."""


def _check_keys(node, cls, prefix: str, *, algo: type) -> None:
    """Refuse keys the dataclasses do not declare (`+group.key=...` would otherwise be dropped);
    the algo node is checked against the objective's class `algo`."""
    fields = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in node.keys():
        if key not in fields:
            where = (f" (algo.name={node.get('name')} declares no such field; an objective is selected "
                     "with algo=<name>)") if cls is algo else ""
            if prefix + str(key) in RENAMED:
                where = f" (renamed {RENAMED[prefix + str(key)]})"
            raise ValueError(f"unknown config key {prefix + str(key)!r}{where}")
        sub = algo if (cls is RunConfig and key == "algo") else hints.get(key)
        if dataclasses.is_dataclass(sub):
            _check_keys(node[key], sub, f"{prefix}{key}.", algo=algo)


def _one_line(e: BaseException) -> str:
    """Hydra/OmegaConf errors as one line a user can act on (the root cause, not the wrapper)."""
    root = e.__cause__ or e
    msg = str(root).split("\n")[0].strip()
    key = re.search(r"full_key: (\S+)", str(root))
    m = re.match(r"Could not override '([^']+)'", msg) or re.match(r"Key '([^']+)' (is )?not in", msg)
    if m:
        name = m.group(1) if m.re.pattern.startswith("Could") or key is None else key.group(1)
        return f"unknown config key {name!r}"
    if "Config search path" in str(e):
        msg = str(e).split("Config search path")[0].strip()
    msg = " ".join(msg.split())
    return f"{key.group(1)}: {msg}" if key and key.group(1) not in msg else msg


def write_run_config(cfg) -> None:
    """The resolved configuration into <run_dir>/config.yaml (what `hpc-tba status`/`report` read
    and a resume recomposes); written once per run, by rank 0."""
    from hpc_tba.config import to_yaml

    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
