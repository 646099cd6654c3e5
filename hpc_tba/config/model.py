"""Typed configuration of the policy model (`model=` group)."""
from __future__ import annotations

import dataclasses

from hpc_tba.config.ranges import SEED_NOTE, check_ranges, ranged


@dataclasses.dataclass
class ModelConfig:
    """Which policy to train. `path: embedded` builds the tiny local Llama (cached under cache_dir)."""

    path: str = "embedded"
    """A Hugging Face directory on local disk, or `embedded` for the tiny locally built Llama."""
    cache_dir: str = "~/.cache/hpc_tba/models"
    """Where the embedded model, its tokenizer and its supervised warm start are cached."""
    hidden_size: int = ranged(128, ge=64)
    """Embedded model only: width (head_dim = hidden/heads must be >= 64 for vLLM's CPU kernels)."""
    num_layers: int = ranged(2, ge=1)
    """Embedded model only: transformer layers."""
    num_heads: int = ranged(2, ge=1)
    """Embedded model only: attention heads."""
    sft_steps: int = ranged(1000, ge=0)
    """Embedded model only: most supervised warm-start steps (partly right, like the papers' SFT
    start); with a band the warm start stops earlier, as soon as it is inside the band."""
    sft_lr: float = ranged(1e-3, gt=0)
    """Embedded model only: warm-start Adam learning rate."""
    warm_start_band: list[float] = dataclasses.field(default_factory=lambda: [0.45, 0.60])
    """Embedded model only: [low, high] held-out greedy pass@1 at which the warm start stops, so
    the RL run starts with the same headroom on every machine; [] trains exactly sft_steps."""
    warm_start_eval_every: int = ranged(5, ge=1)
    """Embedded model only: warm-start steps between held-out checks of the band."""
    seed: int = ranged(0, ge=0, note=SEED_NOTE)
    """Seed of the embedded model's initialisation and warm start."""

    def __post_init__(self) -> None:
        check_ranges(self, "model")
        if self.path != "embedded" and not self.path:
            raise ValueError("model.path is empty: give a local Hugging Face directory or `embedded`")
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 64:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a whole "
                "head_dim >= 64 (vLLM's CPU attention needs it)")
        band = self.warm_start_band
        if band and not (len(band) == 2 and 0.0 <= band[0] < band[1] <= 1.0):
            raise ValueError(f"model.warm_start_band={list(band)} must be [] or [low, high] with "
                             "0 <= low < high <= 1 (held-out pass@1)")
