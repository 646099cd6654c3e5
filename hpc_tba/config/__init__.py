"""Typed configuration, the ground floor: one dataclass per component, mirrored by `configs/`.

Each dataclass documents every field and validates its values in `__post_init__`; nothing here
imports the rest of hpc_tba (or torch), so every layer may import it. Hydra composition and the
checks across components live in hpc_tba.assembly.compose; each objective's own config (a
subclass of AlgoConfig) lives with its loss (hpc_tba.losses.registry).

    model.py ModelConfig · algo.py AlgoConfig · task.py TaskConfig · buffer.py BufferConfig ·
    learner.py LearnerConfig, resolve_wire_dtype · searcher.py SearcherConfig ·
    cluster.py ClusterConfig · run.py RunConfig, ConfigError, to_yaml ·
    ranges.py Range, ranged, check_ranges (each numeric field's range, checked in one place)
"""
from hpc_tba.config.algo import AlgoConfig
from hpc_tba.config.buffer import BufferConfig
from hpc_tba.config.cluster import ClusterConfig
from hpc_tba.config.learner import LearnerConfig, resolve_wire_dtype
from hpc_tba.config.model import ModelConfig
from hpc_tba.config.ranges import Range, check_ranges, range_of, ranged
from hpc_tba.config.run import ConfigError, RunConfig, to_yaml
from hpc_tba.config.searcher import SearcherConfig
from hpc_tba.config.task import TaskConfig

__all__ = ["AlgoConfig", "BufferConfig", "ClusterConfig", "ConfigError", "LearnerConfig", "ModelConfig", "Range",
           "RunConfig", "SearcherConfig", "TaskConfig", "check_ranges", "range_of", "ranged", "resolve_wire_dtype",
           "to_yaml"]
