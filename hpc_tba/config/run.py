"""The whole run's configuration: one typed dataclass per component (composed by
hpc_tba.assembly.compose, which also runs the checks across components)."""
from __future__ import annotations

import dataclasses

from hpc_tba.config.algo import AlgoConfig
from hpc_tba.config.buffer import BufferConfig
from hpc_tba.config.cluster import ClusterConfig
from hpc_tba.config.learner import LearnerConfig
from hpc_tba.config.model import ModelConfig
from hpc_tba.config.searcher import SearcherConfig
from hpc_tba.config.task import TaskConfig


class ConfigError(ValueError):
    """A configuration a user wrote that cannot run; the message names the problem."""


@dataclasses.dataclass
class RunConfig:
    """Everything one run needs."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    """The objective's config: composition puts an instance of the objective's own subclass here
    (hpc_tba.losses.registry); a bare AlgoConfig holds only the fields common to all objectives."""
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
        if self.resume not in ("never", "auto") and not self.resume.startswith(("/", ".", "~")):
            raise ValueError(f"resume={self.resume!r}: use never, auto, or a checkpoint directory path")
        smoke = self.cluster.smoke_preempt_step
        if smoke and not (smoke < self.learner.total_steps and self.resume == "auto"):
            raise ValueError(f"cluster.smoke_preempt_step={smoke}: the smoke job's preemption must come "
                             f"before learner.total_steps={self.learner.total_steps}, and the requeued "
                             f"job must resume from it (resume=auto, got resume={self.resume})")
        if self.learner.mode == "sync" and self.searcher.samples_per_prompt < self.searcher.k:
            raise ValueError(f"learner.mode=sync trains on K={self.searcher.k} of each prompt's "
                             f"samples: searcher.samples_per_prompt={self.searcher.samples_per_prompt}"
                             " must be >= searcher.k")
        budget = self.learner.micro_batch_tokens
        if budget and budget < self.searcher.max_model_len:
            raise ValueError(f"learner.micro_batch_tokens={budget} is below searcher.max_model_len="
                             f"{self.searcher.max_model_len}: a whole sequence (prompt + response) must "
                             "fit one packed micro-batch")
        if self.learner.mode == "sync" and self.task.name == "offline":
            raise ValueError("learner.mode=sync needs searchers; task=offline trains from a file")


def to_yaml(cfg: RunConfig) -> str:
    """The resolved configuration as yaml (saved in the run directory and in checkpoints); the
    objective's own fields included (OmegaConf keeps the subclass in the base-typed field)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
