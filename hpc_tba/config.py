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
        obj = OmegaConf.to_object(cfg)
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        # Hydra wraps the interesting message; keep it to one line the user can act on.
        msg = " ".join(str(e).split())
        cause = e.__cause__ or e.__context__
        if cause is not None and str(cause) and str(cause) not in msg:
            msg = f"{msg}: {' '.join(str(cause).split())}"
        raise ConfigError(f"bad configuration: {msg}") from None
    except Exception as e:  # hydra.errors.* (missing config group option, bad override syntax)
        if type(e).__module__.startswith("hydra"):
            raise ConfigError(f"bad configuration: {' '.join(str(e).split())}") from None
        raise
    assert isinstance(obj, RunConfig)
    obj.run_dir = os.path.abspath(os.path.expanduser(obj.run_dir))
    return obj


def to_yaml(cfg: RunConfig) -> str:
    """The resolved configuration as yaml (saved in the run directory and in checkpoints)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
