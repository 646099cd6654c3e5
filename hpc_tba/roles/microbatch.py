"""One learner step as several micro-batches whose accumulated gradient equals the one-batch one.

Which rows go together (`plan`): sequences are sorted by length so that each micro-batch is
padded only to its own longest sequence. When `micro_batch_size` holds a whole prompt group
(the default, micro = K), micro-batches are made of whole groups (longest groups first, packed
greedily), so every group statistic is computed inside one micro-batch; otherwise sequences of
a group are spread over several micro-batches ("split").

Why the update is exact (`accumulate`): every loss is evaluated on the WHOLE step's rows, with
the log-probs of the current micro-batch's rows attached to the graph and every other row a
detached constant ("context"). By the chain rule the backward of micro-batch m then gives
Σ_{i in m} ∂L/∂S_i ∇θ S_i, and summing over micro-batches gives ∇θ L exactly, for any loss, as
long as ∂L/∂S_i is evaluated at the true values. The context values matter only where the
derivative of one row's loss depends on another row's current log-probs, i.e. on θ-dependent
group statistics: TB's VarGrad logZ = sg[mean_j (r/β − S_j + S_ref_j)], RLOO's KL-shaped
leave-one-out baseline, DPO's pair partner (what the objective declares, `losses.group_coupled`). Rules:

- whole groups per micro-batch: context rows are never in the current row's group, any finite
  value will do (zeros); no extra pass.
- split groups and a group-coupled loss: a no-grad forward first fills the context with the
  current log-probs of every micro-batch but the first (`context_passes`): the first one's
  backward needs only the others' values, and each micro-batch's forward with grad writes its
  own detached log-probs into the context for the micro-batches after it, at the same weights
  (the cost: an extra forward of M − 1 of the M micro-batches; it was all M).
- split groups, a loss whose group statistics depend on rewards only (GRPO's mean/std, RLOO
  without KL) or none (SFT, TOPR, A-LoL): zeros again, the statistics come from the whole
  step's rewards because the loss sees every row.

The normaliser is the global one of the step, so the loss is the same function as without
micro-batching. Reported loss and metrics come from one no-grad evaluation on the assembled
log-probs of the whole step: the values the one-batch step reports.

With a token budget (`plan_tokens`, learner.micro_batch_tokens) the micro-batches are bins that
compute at most that many positions instead, filled longest first (first-fit decreasing): whole
prompt groups when every group fits a bin, else single sequences (split, as above); each bin runs
packed, several sequences to a row as long as its longest (roles.policy `pack_rows`), so only the
rows' tails are padding. The rules above hold unchanged: only which rows go together differs.

Every learner rank must run the same number of forwards (ZeRO-3 gathers parameters in each):
`agree` makes the count (and whether a context pass runs) the maximum over ranks, splitting the
largest micro-batches of ranks that have fewer, or adding a zero-weight one.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from hpc_tba.config import AlgoConfig
from hpc_tba.losses import LossInputs, compute_loss, group_coupled
from hpc_tba.roles.policy import PackedBatch, pack_rows


@dataclasses.dataclass(frozen=True)
class MicroPlan:
    """Row indices of each micro-batch of one step, and whether a prompt group was split."""

    rows: list[np.ndarray]
    split: bool
    padding: list[bool] = dataclasses.field(default_factory=list)
    """Per micro-batch: True for a zero-weight forward that only keeps ranks in step."""

    def __post_init__(self) -> None:
        if not self.padding:
            object.__setattr__(self, "padding", [False] * len(self.rows))


def plan(lengths: np.ndarray, group_ids: np.ndarray, micro: int) -> MicroPlan:
    """Micro-batches of at most `micro` rows, sorted by length (module docstring)."""
    if micro < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {micro}")
    lengths, groups = _groups(lengths, group_ids, "plan")
    if max(len(v) for v in groups.values()) <= micro:
        order = sorted(groups.values(), key=lambda rows: -int(lengths[rows].max()))
        out: list[list[int]] = []
        for rows in order:  # longest groups first; a group joins the current batch if it fits
            if out and len(out[-1]) + len(rows) <= micro:
                out[-1].extend(rows)
            else:
                out.append(list(rows))
        return MicroPlan([np.sort(np.asarray(r, dtype=np.int64)) for r in out], split=False)
    order = np.argsort(-lengths, kind="stable")
    return MicroPlan([np.sort(order[s: s + micro]) for s in range(0, len(order), micro)], split=True)


def _groups(lengths, group_ids, caller: str) -> tuple[np.ndarray, dict[int, list[int]]]:
    """The lengths as an array and the row indices of each prompt group, in row order."""
    lengths, group_ids = np.asarray(lengths), np.asarray(group_ids)
    if lengths.shape != group_ids.shape or lengths.ndim != 1 or lengths.size == 0:
        raise ValueError(f"{caller} needs equal non-empty [B] lengths and group ids, got "
                         f"{lengths.shape} and {group_ids.shape}")
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        groups.setdefault(g, []).append(i)
    return lengths, groups


def plan_tokens(lengths: np.ndarray, group_ids: np.ndarray, budget: int) -> MicroPlan:
    """Micro-batches of at most `budget` token positions as they run packed (`packed_positions`:
    rows as long as the bin's longest sequence), bin-packed longest first: whole groups when each
    group fits one bin, else single sequences (module docstring)."""
    lengths, groups = _groups(lengths, group_ids, "plan_tokens")
    if int(lengths.max()) > budget:
        i = int(lengths.argmax())
        raise ValueError(f"a sequence of {int(lengths[i])} tokens (row {i}) exceeds "
                         f"learner.micro_batch_tokens={budget}: raise the budget to at least the longest "
                         "prompt + response (searcher.max_model_len)")
    split = max(packed_positions(lengths[rows]) for rows in groups.values()) > budget
    items = [[i] for i in range(lengths.size)] if split else list(groups.values())
    items.sort(key=lambda rows: -int(lengths[rows].sum()))  # stable: ties keep their order
    bins: list[list[int]] = []
    tokens: list[int] = []  # real tokens per bin: a lower bound of its positions, checked first
    for rows in items:  # first fit: the first bin whose packed rows stay within the budget
        need = int(lengths[rows].sum())
        at = next((b for b, have in enumerate(bins) if tokens[b] + need <= budget
                   and packed_positions(lengths[have + rows]) <= budget), None)
        if at is None:
            bins.append([])
            tokens.append(0)
            at = len(bins) - 1
        bins[at].extend(rows)
        tokens[at] += need
    return MicroPlan([np.sort(np.asarray(b, dtype=np.int64)) for b in bins], split=split)


def packed_positions(lengths: np.ndarray) -> int:
    """Token positions a packed micro-batch of these sequences computes: its rows (roles.policy
    `pack_rows`) x its longest sequence, the tails' padding included."""
    lengths = [int(n) for n in lengths]
    return len(pack_rows(lengths)[2]) * max(lengths)


def agree(p: MicroPlan, reduce_max: Callable[[dict[str, float]], dict[str, float]]) -> MicroPlan:
    """`p` with as many micro-batches as the rank that has most, and the same `split` flag.

    A rank with fewer micro-batches splits its largest ones, which may cut a group, so it then
    needs the context pass; every rank must then run it too (same number of forwards under
    ZeRO-3): `split` is True on all ranks as soon as the counts differ anywhere (the minimum
    travels as the max of its negative, in the same one collective).
    """
    g = reduce_max({"count": float(len(p.rows)), "split": float(p.split), "-count": -float(len(p.rows))})
    target = int(g["count"])
    split = bool(g["split"]) or p.split or -int(g["-count"]) < target
    rows, padding = list(p.rows), list(p.padding)
    while len(rows) < target:
        big = max(range(len(rows)), key=lambda i: len(rows[i]))
        if len(rows[big]) < 2:  # nothing left to split: a zero-weight forward on one row
            rows.append(rows[0][:1])
            padding.append(True)
            continue
        half = len(rows[big]) // 2
        rows[big:big + 1] = [rows[big][:half], rows[big][half:]]
        padding[big:big + 1] = [padding[big], padding[big]]
    return MicroPlan(rows, split=split, padding=padding)


def no_grad_logprobs(logprobs: Callable[[PackedBatch], torch.Tensor], packed: PackedBatch,
                     p: MicroPlan) -> torch.Tensor:
    """[B, T] float32 log-probs of a frozen model (the reference), micro-batch by micro-batch of
    `p` (padding ones run too: every rank the same forwards), without grad."""
    out = torch.zeros(packed.response_mask.shape, dtype=torch.float32, device=packed.device)
    with torch.no_grad():
        for rows, pad in zip(p.rows, p.padding):
            idx = torch.as_tensor(rows, device=packed.device)
            part = logprobs(packed.select(idx))
            if not pad:
                out[idx, : part.shape[1]] = part
    return out


def needs_context(cfg: AlgoConfig, p: MicroPlan) -> bool:
    """Whether the current log-probs of other rows are needed for an exact gradient."""
    return p.split and group_coupled(cfg)


def context_passes(cfg: AlgoConfig, p: MicroPlan) -> list[int]:
    """The micro-batches (indices into `p.rows`) the no-grad context pass runs: every one but the
    first when `needs_context`, else none (module docstring). The same count on every rank of an
    agreed plan (padding micro-batches included)."""
    return list(range(1, len(p.rows))) if needs_context(cfg, p) else []


def _scatter(base: torch.Tensor, rows: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """`base` with `part` ([b, t], t <= T) written into `rows`; differentiable in `part`."""
    pad = torch.nn.functional.pad(part, (0, base.shape[1] - part.shape[1]))
    return base.index_put((rows,), pad)


def accumulate(cfg: AlgoConfig, inputs: LossInputs, p: MicroPlan, *,
               logp_fn: Callable[[torch.Tensor], torch.Tensor],
               backward: Callable[[torch.Tensor, bool], None],
               step: int, normalizer: float,
               check: Callable[[torch.Tensor], bool] = lambda loss: True):
    """Forward/backward every micro-batch of `p`; returns (loss, metrics, whole-step log-probs).

    `inputs` holds the whole step's tensors (its `logp` gives only shape and dtype); `logp_fn(rows)` returns the
    [b, t] log-probs of those rows with grad (t <= T); `backward(loss, last)` back-propagates
    one micro-batch's loss (last: it is the step's final one). `check(loss)` is asked before each
    backward; False stops the step (returns loss None). Collective calls inside the callables
    run the same number of times on every rank when `p` went through `agree`.
    """
    if inputs.logz is not None and inputs.logz.requires_grad:
        raise ValueError("micro-batching evaluates the loss on the whole step once per micro-batch, "
                         "so a learned logZ (algo.tb_logz=learned) would collect its gradient once "
                         "per micro-batch; the learner supports tb_logz=vargrad only")
    dev = inputs.mask.device
    context = torch.zeros(inputs.mask.shape, dtype=inputs.logp.dtype, device=dev)  # logp's dtype
    idx = [torch.as_tensor(r, device=dev) for r in p.rows]
    coupled = needs_context(cfg, p)
    with torch.no_grad():
        for i in context_passes(cfg, p):
            part = logp_fn(idx[i])
            if not p.padding[i]:
                context = _scatter(context, idx[i], part.to(context.dtype))
    final = context.clone()
    for i, (rows, pad) in enumerate(zip(idx, p.padding)):
        part = logp_fn(rows)
        if pad:
            loss = part.sum() * 0.0
        else:
            logp = _scatter(context, rows, part.to(context.dtype))
            loss, _ = compute_loss(cfg, dataclasses.replace(inputs, logp=logp), step=step, normalizer=normalizer)
            final = _scatter(final, rows, part.detach().to(final.dtype))
            if coupled:  # the micro-batches after this one read these rows from the context
                context = _scatter(context, rows, part.detach().to(context.dtype))
        if not check(loss):
            return None, {}, final
        backward(loss, i == len(idx) - 1)
    with torch.no_grad():
        loss, metrics = compute_loss(cfg, dataclasses.replace(inputs, logp=final), step=step,
                                     normalizer=normalizer)
    return loss, metrics, final


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, *,
                     num_groups: int | None = None) -> torch.Tensor:
    """A = R − mean R of the prompt's group ([B], on the rewards' device). `num_groups` (groups
    are 0..num_groups-1), when the caller knows it on the host, spares a device-to-host sync."""
    n = int(groups.max()) + 1 if num_groups is None else num_groups
    means = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, groups, rewards)
    counts = torch.zeros_like(means).index_add_(0, groups, torch.ones_like(rewards))
    return rewards - (means / counts.clamp(min=1))[groups]
