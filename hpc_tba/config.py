"""The run's configuration: one typed dataclass per component, composed by Hydra.

`configs/` holds one yaml group per component (model, algo, task, buffer, learner, searcher,
cluster) plus `experiment/` presets. Every yaml is merged onto the dataclass schema registered
here, so an unknown or mistyped key fails at composition with the key's name, and each
component's `__post_init__` validates values. The DictConfig stops at `compose()`: components
receive only their own dataclass.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from hpc_tba.buffer.config import BufferConfig
from hpc_tba.launcher.config import ClusterConfig
from hpc_tba.losses.config import LossConfig
from hpc_tba.models.config import ModelConfig
from hpc_tba.roles.config import LearnerConfig, SearcherConfig
from hpc_tba.tasks.config import TaskConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A configuration a user wrote that cannot run; the message names the problem."""


@dataclasses.dataclass
class RunConfig:
    """Everything one run needs."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    algo: LossConfig = dataclasses.field(default_factory=LossConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    buffer: BufferConfig = dataclasses.field(default_factory=BufferConfig)
    learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
    searcher: SearcherConfig = dataclasses.field(default_factory=SearcherConfig)
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    run_dir: str = "runs/default"
    """Run directory (TensorBoard events, buffer segments, checkpoints); shared filesystem on Slurm."""
    name: str = "tba"
    """Run name shown in logs."""
    resume: str = "never"
    """never | auto (the latest complete checkpoint in run_dir, if any) | a checkpoint directory."""

    def __post_init__(self) -> None:
        from hpc_tba.tasks.fit import fit_run

        fit_run(self)  # reward map, sampler: task, algo and buffer must fit (tasks/fit.py)
        if self.resume not in ("never", "auto") and not self.resume.startswith(("/", ".", "~")):
            raise ValueError(f"resume={self.resume!r}: use never, auto, or a checkpoint directory path")
        if self.learner.mode == "sync" and self.searcher.samples_per_prompt < self.searcher.k:
            raise ValueError(f"learner.mode=sync trains on K={self.searcher.k} of each prompt's "
                             f"samples: searcher.samples_per_prompt={self.searcher.samples_per_prompt}"
                             " must be >= searcher.k")
        if self.learner.mode == "sync" and self.task.name == "offline":
            raise ValueError("learner.mode=sync needs searchers; task=offline trains from a file")


def _register() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, cls in (("model", ModelConfig), ("algo", LossConfig), ("task", TaskConfig),
                       ("buffer", BufferConfig), ("learner", LearnerConfig),
                       ("searcher", SearcherConfig), ("cluster", ClusterConfig)):
        cs.store(group=group, name=f"{group}_schema", node=cls)


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
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
        _check_keys(cfg, RunConfig, "")
        obj = OmegaConf.to_object(cfg)
    except Exception as e:
        if isinstance(e, (OmegaConfBaseException, ValueError, TypeError)) or \
                type(e).__module__.startswith("hydra"):
            raise ConfigError(f"bad configuration: {_one_line(e)}") from None
        raise
    assert isinstance(obj, RunConfig)
    obj.run_dir = os.path.abspath(os.path.expanduser(obj.run_dir))
    return obj


def _check_keys(node, cls, prefix: str) -> None:
    """Refuse keys the dataclasses do not declare (`+group.key=...` would otherwise be dropped)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in node.keys():
        if key not in fields:
            raise ValueError(f"unknown config key {prefix + str(key)!r}")
        ftype = fields[key].type
        sub = globals().get(ftype) if isinstance(ftype, str) else ftype
        if dataclasses.is_dataclass(sub):
            _check_keys(node[key], sub, f"{prefix}{key}.")


def _one_line(e: BaseException) -> str:
    """Hydra/OmegaConf errors as one line a user can act on (the root cause, not the wrapper)."""
    import re

    root = e.__cause__ or e
    msg = str(root).split("\n")[0].strip()
    key = re.search(r"full_key: (\S+)", str(root))
    m = re.match(r"Could not override '([^']+)'", msg) or re.match(r"Key '([^']+)' not in", msg)
    if m:
        name = m.group(1) if m.re.pattern.startswith("Could") or key is None else key.group(1)
        return f"unknown config key {name!r}"
    if "Config search path" in str(e):
        msg = str(e).split("Config search path")[0].strip()
    msg = " ".join(msg.split())
    return f"{key.group(1)}: {msg}" if key and key.group(1) not in msg else msg


def to_yaml(cfg: RunConfig) -> str:
    """The resolved configuration as yaml (saved in the run directory and in checkpoints)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
