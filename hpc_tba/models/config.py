"""Typed configuration of the policy model (`model=` group)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ModelConfig:
    """Which policy to train. `path: embedded` builds the tiny local Llama (cached under cache_dir)."""

    path: str = "embedded"
    """A Hugging Face directory on local disk, or `embedded` for the tiny locally built Llama."""
    cache_dir: str = "~/.cache/hpc_tba/models"
    """Where the embedded model, its tokenizer and its supervised warm start are cached."""
    hidden_size: int = 128
    """Embedded model only: width (head_dim = hidden/heads must be >= 64 for vLLM's CPU kernels)."""
    num_layers: int = 2
    """Embedded model only: transformer layers."""
    num_heads: int = 2
    """Embedded model only: attention heads."""
    sft_steps: int = 550
    """Embedded model only: supervised warm-start steps (partly right, like the papers' SFT start)."""
    seed: int = 0
    """Seed of the embedded model's initialisation and warm start."""

    def __post_init__(self) -> None:
        if self.path != "embedded" and not self.path:
            raise ValueError("model.path is empty: give a local Hugging Face directory or `embedded`")
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 64:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a whole "
                "head_dim >= 64 (vLLM's CPU attention needs it)")
