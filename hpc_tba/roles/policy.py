"""Turning sampled trajectories into tensors, and log-probs of responses under a causal LM.

Shared by the learner (current policy and reference) and by the sync checks in tests, so that
"the learner's log-prob of a sampled token" is computed in exactly one way.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from hpc_tba.losses import token_logprobs


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Prompt+response sequences right-padded, with response-token bookkeeping."""

    input_ids: torch.Tensor  # [B, L] prompt then response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    response_ids: torch.Tensor  # [B, T] response tokens, right-padded with 0
    response_mask: torch.Tensor  # [B, T] bool, True on response tokens
    logit_index: torch.Tensor  # [B, T] position in input_ids whose logits predict the token

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())


def pack(prompts: list[np.ndarray], responses: list[np.ndarray], *, pad_id: int) -> PackedBatch:
    b = len(prompts)
    seq_len = max(len(p) + len(r) for p, r in zip(prompts, responses))
    t = max(1, max(len(r) for r in responses))
    ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    attn = torch.zeros((b, seq_len), dtype=torch.long)
    resp = torch.zeros((b, t), dtype=torch.long)
    rmask = torch.zeros((b, t), dtype=torch.bool)
    index = torch.zeros((b, t), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n_p, n_r = len(p), len(r)
        ids[i, :n_p] = torch.from_numpy(np.asarray(p, dtype=np.int64))
        ids[i, n_p:n_p + n_r] = torch.from_numpy(np.asarray(r, dtype=np.int64))
        attn[i, :n_p + n_r] = 1
        resp[i, :n_r] = torch.from_numpy(np.asarray(r, dtype=np.int64))
        rmask[i, :n_r] = True
        index[i, :n_r] = torch.arange(n_p - 1, n_p + n_r - 1)
    return PackedBatch(ids, attn, resp, rmask, index)


def pad_per_token(values: list[np.ndarray], like: torch.Tensor) -> torch.Tensor:
    """Ragged per-token float arrays -> [B, T] float32 aligned with a PackedBatch's responses."""
    out = torch.zeros(like.shape, dtype=torch.float32)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.as_tensor(v, dtype=torch.float32)
    return out


def response_logprobs(model, batch: PackedBatch, *, temperature: float) -> torch.Tensor:
    """[B, T] log π(response token) from logits / temperature; padding positions are 0."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    idx = batch.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    picked = logits.gather(1, idx)  # [B, T, V]
    logp = token_logprobs(picked, batch.response_ids, temperature=temperature)
    return logp.masked_fill(~batch.response_mask, 0.0)
