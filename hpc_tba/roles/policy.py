"""Turning sampled trajectories into tensors, and log-probs of responses under a causal LM.

Shared by the learner (current policy and reference) and by the sync checks in tests, so that
"the learner's log-prob of a sampled token" is computed in exactly one way.

Memory: `response_logprobs` never builds the logits of the whole batch. The model's output head
is swapped, for the duration of one forward, for a function that takes the final hidden states
of the response positions only and runs head + fp32 log-softmax on `chunk_tokens` of them at a
time (each chunk recomputed in the backward pass instead of kept, `_ChosenLogprobs`), so the
largest vocabulary tensor is [chunk_tokens, V], one of them live at a time. The head is still
called as the model's own submodule inside the model's forward, so DeepSpeed ZeRO-3 gathers and
releases its weight exactly as for a plain forward.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Prompt+response sequences with response-token bookkeeping: one right-padded row per
    sequence, or (`packed`) several sequences concatenated in one row, each with its own
    position ids, attending only within itself."""

    input_ids: torch.Tensor  # [B, L] prompt then response, right-padded; packed: [R, L'] rows of sequences
    attention_mask: torch.Tensor | None  # [B, L]; packed: None (the position ids delimit sequences)
    response_ids: torch.Tensor  # [B, T] response tokens, right-padded with 0
    response_mask: torch.Tensor  # [B, T] bool, True on response tokens
    logit_index: torch.Tensor  # [B, T] position in its input_ids row whose logits predict the token
    position_ids: torch.Tensor | None = None  # packed: [R, L'], 0.. again at each sequence's start
    hidden_row: torch.Tensor | None = None  # packed: [B] the input_ids row each sequence is in
    packing: bool = False  # `select` packs the rows it takes (learner.micro_batch_tokens)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def select(self, rows: torch.Tensor) -> PackedBatch:
        """The given rows, padded only to their own longest sequence and response, or, when
        `packing`, packed several to a row (`_packed`)."""
        attn, rmask = self.attention_mask[rows], self.response_mask[rows]
        t = max(1, int(rmask.sum(dim=-1).max())) if rows.numel() else 1
        if self.packing:
            return self._packed(rows, attn, t)
        seq_len = max(1, int(attn.sum(dim=-1).max())) if rows.numel() else 1
        return PackedBatch(self.input_ids[rows, :seq_len], attn[:, :seq_len], self.response_ids[rows, :t],
                           rmask[:, :t], self.logit_index[rows, :t])

    def _packed(self, rows: torch.Tensor, attn: torch.Tensor, t: int) -> PackedBatch:
        """The sequences of `rows` packed into rows as long as the longest of them (first fit,
        longest first): attention is dense within a row (sdpa's block mask), so a row no longer
        than a padded one costs no more, and only the rows' tails are padding. A tail counts its
        positions from 0, a sequence of its own that no response reads."""
        lengths = attn.sum(dim=-1).tolist()
        row_of, start, room = pack_rows(lengths)
        cap = max(lengths)
        dev = self.input_ids.device
        ids = torch.full((len(room), cap), 0, dtype=torch.long, device=dev)
        positions = torch.arange(cap, device=dev).repeat(len(room), 1)
        src = self.input_ids[rows]
        for i, (r, s, n) in enumerate(zip(row_of, start, lengths)):
            ids[r, s:s + n] = src[i, :n]
            positions[r, s:s + n] = torch.arange(n, device=dev)
        for r, free in enumerate(room):  # the tail: its own sequence, counted from 0
            positions[r, cap - free:] = torch.arange(free, device=dev)
        hidden_row = torch.tensor(row_of, dtype=torch.long, device=dev)
        offset = torch.tensor(start, dtype=torch.long, device=dev)
        return PackedBatch(ids, None, self.response_ids[rows, :t], self.response_mask[rows, :t],
                           self.logit_index[rows, :t] + offset[:, None], position_ids=positions,
                           hidden_row=hidden_row)


def pack_rows(lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Sequences of these lengths in rows as long as the longest (first fit, longest first): each
    one's row and start, and each row's free tail. The micro-batch planner counts a bin's cost
    with it (rows x longest), so the packing it plans is the packing that runs."""
    cap = max(lengths)
    row_of, start, room = [0] * len(lengths), [0] * len(lengths), []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = next((r for r, free in enumerate(room) if free >= lengths[i]), len(room))
        if at == len(room):
            room.append(cap)
        row_of[i], start[i] = at, cap - room[at]
        room[at] -= lengths[i]
    return row_of, start, room


def pack(prompts: list[np.ndarray], responses: list[np.ndarray], *, pad_id: int,
         device: torch.device | str = "cpu", packing: bool = False) -> PackedBatch:
    """Right-padded tensors of the sequences, built on the host and moved to `device` at once;
    `packing`: its `select` concatenates the rows it takes into one packed row."""
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
    dev = torch.device(device)
    return PackedBatch(*(x.to(dev) for x in (ids, attn, resp, rmask, index)), packing=packing)


def pad_per_token(values: list[np.ndarray], like: torch.Tensor) -> torch.Tensor:
    """Ragged per-token float arrays -> [B, T] float32 aligned with `like`, on `like`'s device."""
    if len(values) != like.shape[0] or any(len(v) > like.shape[1] for v in values):
        longest = max((len(v) for v in values), default=0)
        raise ValueError(f"pad_per_token: {len(values)} rows of up to {longest} values do not fit the "
                         f"[B, T]={list(like.shape)} responses: per-token values and responses disagree")
    out = torch.zeros(like.shape, dtype=torch.float32)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.as_tensor(v, dtype=torch.float32)
    return out.to(like.device)


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   temperature: float) -> torch.Tensor:
    """head(hidden) / T for [N, H] hidden states: [N, V], float32 at least (one [N, V] buffer
    for a float32 model: the division runs in place on the head's fresh output)."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits.div_(temperature)


class _ChosenLogprobs(torch.autograd.Function):
    """log softmax(head(hidden) / T)[target] for [N, H] hidden states: [N], float32 at least.

    Forward keeps only the hidden states, the targets and the [N] log-sum-exp; backward
    recomputes the logits once and turns them into their gradient in place,
    (onehot(target) − softmax) · g / T, so one [N, V] buffer is live at a time (autograd through
    linear, log-softmax and gather would hold three: the log-softmax, its gradient and the
    scattered one-hot gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature):
        logits = _scaled_logits(hidden, weight, bias, temperature)
        lse = torch.logsumexp(logits, dim=-1)
        ctx.temperature = temperature
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        g = (grad / ctx.temperature).unsqueeze(-1)  # [N, 1]
        dlogits = _scaled_logits(hidden, weight, bias, ctx.temperature)
        dlogits.sub_(lse.unsqueeze(-1)).exp_().mul_(-g)  # − softmax · g / T
        dlogits.scatter_add_(-1, targets.unsqueeze(-1), g)  # + onehot · g / T
        dlogits = dlogits.to(hidden.dtype)
        need = ctx.needs_input_grad
        d_hidden = dlogits @ weight if need[0] else None
        d_weight = dlogits.t() @ hidden if need[1] else None
        d_bias = dlogits.sum(0) if bias is not None and need[2] else None
        return d_hidden, d_weight, d_bias, None, None


def _chosen_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(head(hidden) / T)[target] for [N, H] hidden states: [N], float32 at least."""
    return _ChosenLogprobs.apply(hidden, weight, bias, targets, temperature)


def _head_forward(head: torch.nn.Module, batch: PackedBatch, temperature: float, chunk: int,
                  window: tuple[int, int] | None = None):
    """A replacement `forward` of the output head: hidden [B, L, H] -> [B, T] chosen log-probs.

    `window` (sequence parallelism): the hidden states are those of positions [start, stop)
    only; the tokens those positions predict get their log-probs, every other one 0.
    """
    mask = batch.response_mask
    if window is not None:
        mask = mask & (batch.logit_index >= window[0]) & (batch.logit_index < window[1])
    rows, cols = mask.nonzero(as_tuple=True)  # response positions only (of the window)
    targets = batch.response_ids[rows, cols]
    positions = batch.logit_index[rows, cols] - (0 if window is None else window[0])
    hidden_rows = rows if batch.hidden_row is None else batch.hidden_row[rows]  # packed: the one row

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        picked = hidden[hidden_rows, positions]  # [N, H]: no padding, no prompt positions
        parts = []
        # at least one (maybe empty) chunk: the output stays attached to the hidden states and the
        # head's weight even when no response token is here (an SP rank whose positions are all
        # prompt), so every rank's backward runs the same collectives (ZeRO-3, all-to-alls)
        for start in range(0, max(picked.shape[0], 1), chunk):
            args = (picked[start: start + chunk], head.weight, getattr(head, "bias", None),
                    targets[start: start + chunk], temperature)
            parts.append(_chosen_logprobs(*args))  # keeps the chunk's hidden states, recomputes logits
        dtype = torch.promote_types(picked.dtype, torch.float32)
        flat = torch.cat(parts)
        out = torch.zeros(batch.response_mask.shape, dtype=dtype, device=flat.device)
        return out.index_put((rows, cols), flat)

    return forward


# Config fields of families whose causal-LM forward rescales or caps the head's output before
# returning it (Gemma2/3/4 soft-capping, Cohere `logit_scale`, Granite `logits_scaling`, Falcon-H1
# `lm_head_multiplier`): the chunked head's log-probs would come back transformed as if they were
# logits. Refused up front by name; `response_logprobs` also checks, for any other family, that the
# forward returned the head's tensor itself (see there).
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


def _refuse_postprocessed_logits(module) -> None:
    cfg = getattr(module, "config", None)
    if cfg is None:
        return
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for c in {id(cfg): cfg, id(text): text}.values():
        for name in _LOGIT_POSTPROCESSING:
            value = getattr(c, name, None)
            neutral = value is None or (name != "final_logit_softcapping" and value == 1.0) or (
                name == "final_logit_softcapping" and not value)  # a scale of 1 changes nothing
            if not neutral:
                raise ValueError(
                    f"response_logprobs: {type(module).__name__} (model_type "
                    f"{getattr(c, 'model_type', '?')!r}) post-processes its logits ({name}="
                    f"{getattr(c, name)}), which the chunked log-prob head cannot reproduce; "
                    f"this model family is not supported by the learner")


@contextlib.contextmanager
def _head_swapped(model, forward):
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    _refuse_postprocessed_logits(module)
    head = module.get_output_embeddings()
    if head is None:
        raise ValueError(f"response_logprobs: {type(module).__name__} has no output embeddings "
                         f"(get_output_embeddings() is None); a causal LM with an lm_head is needed")
    head.forward = forward(head)  # instance attribute: the module's hooks (ZeRO-3) still run
    try:
        yield
    finally:
        del head.forward


def response_logprobs(model, batch: PackedBatch, *, temperature: float,
                      chunk_tokens: int = 1024, sp=None) -> torch.Tensor:
    """[B, T] log π(response token) from logits / temperature (float32; float64 for a float64
    model); padding positions are 0.

    Logits are computed only at the response positions, `chunk_tokens` of them at a time (module
    docstring); `model` is a Hugging Face causal LM or a DeepSpeed engine around one. `sp` (a
    roles.parallel.SequenceParallel, its model switched to Ulysses attention): this rank runs its
    share of the positions, and the peers' log-probs are gathered into the full [B, T].
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    produced: list[torch.Tensor] = []  # a copy of what the head returned ([B, T]: cheap), so that
    # an in-place change of the returned tensor by the forward is seen too

    window = None
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    if batch.position_ids is not None:
        # packed: no 2D mask, so transformers' mask builder reads the sequences off the position
        # ids (masking_utils.find_packed_sequence_indices; flash-attention: varlen)
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids}
    if sp is not None and sp.enabled:
        if batch.position_ids is not None:
            raise ValueError("response_logprobs: a packed batch under sequence parallelism is not "
                             "supported (learner.micro_batch_tokens with sequence_parallel_size > 1)")
        inputs, start, stop = sp.local_inputs(batch.input_ids)
        window = (start, stop)

    def swap(head):
        fwd = _head_forward(head, batch, temperature, chunk_tokens, window)

        def forward(hidden):
            out = fwd(hidden)
            produced.append(out.detach().clone())
            return out
        return forward

    with _head_swapped(model, swap):
        # use_cache=False: a causal LM's forward otherwise fills a KV cache that keeps every layer's
        # keys and values to the end of the forward (under sequence parallelism a copy besides
        # the all-to-all'd ones attention saves: 12 MiB a layer in tools/bench_sp.py)
        out = model(**inputs, use_cache=False)
    # A forward that transforms the head's output (scaling, capping, a bias) returns other values:
    # our log-probs would then be silently wrong, so any family not caught by name stops here.
    # Values, not identity: ZeRO-3's module hooks re-wrap outputs in autograd functions.
    if len(produced) != 1 or out.logits.shape != produced[0].shape or not torch.equal(out.logits, produced[0]):
        module = getattr(model, "module", model)
        raise ValueError(f"response_logprobs: {type(module).__name__} does not return its output head's "
                         f"result unchanged as logits (head called {len(produced)} times), so the chunked "
                         f"log-prob head would compute wrong log-probs; this model family is not "
                         f"supported by the learner")
    return out.logits if window is None else sp.gather_logprobs(out.logits)
