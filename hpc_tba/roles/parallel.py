"""The learner's parallel layouts beyond ZeRO-3 data parallelism: Ulysses sequence parallelism,
and the replica peers it shares with tensor parallelism (hpc_tba.roles.tensor_parallel).

Layout (hpc_tba.config.topology): the L learner ranks form D = L / SP data-parallel replicas of SP
consecutive ranks each (SP peers sit on one node). A replica's SP peers hold the same sampled
batch (its leader, SP rank 0, owns the buffer shard and broadcasts each step's batch to the
others: `SequenceParallel.share_batch`), run the same micro-batches in lockstep, and split every
sequence's positions: the batch is padded to a multiple of SP and SP rank r runs the model on
positions [r·L/SP, (r+1)·L/SP) with their global `position_ids`.

Attention (`ulysses_attention`, registered with transformers as "hpc_tba_ulysses"): q, k, v of
the local positions and all heads go through one all-to-all to all positions and H/SP heads, the
model's own core attention (sdpa or flash) runs causally on the whole sequence, and a second
all-to-all brings the output back to the local positions and all heads. Sequences are
right-padded (roles.policy.pack), so causal attention without a padding mask is exact on every
real position (a real position never sees a later, padded one). The core's backward needs its
output, and o_proj's needs the all-to-all'd copy of it: only the copy is kept (`_SharedOutput`),
the output is rebuilt from it by the inverse all-to-all when the core's backward runs.

Log-probs and losses: each SP rank computes the chosen-token log-probs of the response tokens
its positions predict (the chunked head of roles.policy), zeros elsewhere; `gather_logprobs`
sums them over the SP group so every peer holds the full [B, T] log-probs and computes the same
loss with the unchanged loss code. Its backward passes the gradient through unchanged (not
summed over the group: the peers' losses are one loss computed SP times), so the SP peers'
parameter gradients sum to the gradient of the replica's loss.

Gradient averaging: the DeepSpeed engine keeps its default group (all L learner ranks: ZeRO-3
partitions over all of them) and AVERAGES gradients over it, i.e. Σ over every rank / L. Every
DP replica counts its loss units once (`dp_units`: the all-rank sum / SP), and the learner's
normaliser stays N / L, so the average equals ∇(Σ_rows ℓ / N) exactly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools

import torch
import torch.distributed as dist

ATTENTION = "hpc_tba_ulysses"
"""The attention implementation name an SP model runs under (transformers AttentionInterface)."""

_CORES = ("sdpa", "flash_attention_2", "flash_attention_3")
"""Core attentions that run causally from `is_causal`/position ids without a 4D mask."""

_STATE: dict[str, object] = {}  # the process's SP group and the core attention (one SP group a rank)


@dataclasses.dataclass
class Peers:
    """This rank's place among its replica's peers (SP here, TP in roles.tensor_parallel): the
    consecutive learner ranks that train one batch together, and their process group."""

    size: int
    rank: int
    """Position among the peers (0: the replica's leader)."""
    group: object | None
    """torch.distributed group of the peers (None when size is 1)."""
    leader: int
    """Rank, in the learners' default group, of the replica's peer rank 0."""

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def dp_units(self, all_rank_units: float) -> float:
        """Loss units of the whole step, counted once per DP replica (the peers share a batch)."""
        return all_rank_units / self.size

    def share_batch(self, batch, device: torch.device):
        """The leader's batch on every peer (the followers pass None)."""
        if not self.enabled:
            return batch
        box = [batch if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group, device=device)
        return box[0]


@dataclasses.dataclass
class SequenceParallel(Peers):
    """This rank's place in the SP layout and its SP process group."""

    # ---------------------------------------------------------------- positions
    def local_inputs(self, input_ids: torch.Tensor, pad_id: int = 0) -> tuple[dict, int, int]:
        """The model inputs of this rank's positions and their window [start, stop) in the
        padded sequence: (input_ids, position_ids), no attention mask (module docstring)."""
        b, length = input_ids.shape
        chunk = -(-length // self.size)
        padded = torch.nn.functional.pad(input_ids, (0, chunk * self.size - length), value=pad_id)
        start = self.rank * chunk
        positions = torch.arange(start, start + chunk, device=input_ids.device).expand(b, chunk)
        return {"input_ids": padded[:, start:start + chunk], "position_ids": positions}, start, start + chunk

    def gather_logprobs(self, local: torch.Tensor) -> torch.Tensor:
        """The full [B, T] log-probs from each peer's own positions (zeros elsewhere), on every
        peer; the gradient passes through to this peer's own positions unchanged."""
        return _SumOfParts.apply(local, self.group) if self.enabled else local


class _SumOfParts(torch.autograd.Function):
    """all_reduce(SUM) forward; identity backward (every peer computes the same loss)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        out = local.detach().clone().contiguous()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _AllToAll(torch.autograd.Function):
    """Equal-split all_to_all_single over dim 0 (of size = group size); the backward is the same
    exchange of the gradients (an equal-split all-to-all is its own inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # first: empty_like keeps a permuted tensor's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _seq_to_heads(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """[B, H, T/SP, D] (local positions, all heads) -> [B, H/SP, T, D] (all positions, my heads),
    laid out [B, T, H/SP, D] in memory as the model's projections lay out q, k and v: the core
    then writes its output in that layout too, which is the one it returns (no copy) and the one
    _heads_to_seq takes, so the output it saves is the tensor _SharedOutput finds."""
    b, h, t, d = x.shape
    x = x.transpose(1, 2).reshape(b, t, sp, h // sp, d).permute(2, 0, 1, 3, 4)  # [SP (head chunk), B, t, H/SP, D]
    x = _AllToAll.apply(x, group)  # [SP (sequence chunk), B, t, H/SP, D]
    return x.permute(1, 0, 2, 3, 4).reshape(b, sp * t, h // sp, d).transpose(1, 2)


def _heads_to_seq(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """[B, T, H/SP, D] (all positions, my heads) -> [B, T/SP, H, D] (local positions, all heads)."""
    b, t, h, d = x.shape
    x = x.reshape(b, sp, t // sp, h, d).permute(1, 0, 2, 3, 4)  # [SP (sequence chunk), B, t, H/SP, D]
    x = _AllToAll.apply(x, group)  # [SP (head chunk), B, t, H/SP, D]
    return x.permute(1, 2, 0, 3, 4).reshape(b, t // sp, sp * h, d)


def ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention interface: all-to-all, the core attention on the whole sequence
    (causal, no mask: right padding), all-to-all back. q/k/v are [B, heads, T/SP, D]."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    group, core = _STATE["group"], _STATE["core"]
    sp = dist.get_world_size(group)
    q, k, v = (_seq_to_heads(x, group, sp) for x in (query, key, value))
    positions = kwargs.get("position_ids")
    if positions is not None:  # flash attention reads them: the whole sequence's
        kwargs["position_ids"] = torch.arange(q.shape[2], device=q.device).expand(q.shape[0], -1)
    kwargs["is_causal"] = True
    shared = _SharedOutput.applies(q, k, v)
    with shared.hooks() if shared else contextlib.nullcontext():
        out, _ = ALL_ATTENTION_FUNCTIONS[core](module, q, k, v, None, **kwargs)
    y = _heads_to_seq(out, group, sp)
    if shared:
        shared.share(out, y, group, sp)
    return y, None


class _SharedOutput:
    """Saved-tensor hooks around the core attention that keep one copy of its output, not two.

    The core (sdpa, flash) saves its output [B, T, H/SP, D] for its backward, and o_proj saves
    its input, the all-to-all'd copy y [B, T/SP, H, D] of the same values: 6 MiB a layer in
    tools/bench_sp.py (36 of the 874 MiB an SP rank saves). After the all-to-all back, the saved
    output is replaced by a recipe: the inverse all-to-all of y (a detached alias of o_proj's
    input), run when the core's backward unpacks it; a pure data movement, so the backward
    computes exactly what it would on the kept tensor. Every SP peer unpacks in the same layer
    of the same backward (as _AllToAll's backward exchanges), so the collective lines up.

    Not used when other saved-tensor hooks are in force (gradient checkpointing's: a nested hook
    would hide the core's tensors from it), or when nothing needs a gradient (the reference)."""

    def __init__(self) -> None:
        self.boxes: list[list] = []

    @staticmethod
    def applies(*inputs: torch.Tensor) -> _SharedOutput | None:
        if not torch.is_grad_enabled() or not any(x.requires_grad for x in inputs):
            return None
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:  # checkpointing
            return None
        return _SharedOutput()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> list:
        box = [t]
        self.boxes.append(box)
        return box

    @staticmethod
    def _unpack(box: list) -> torch.Tensor:
        return box[0] if isinstance(box[0], torch.Tensor) else box[0]()

    def share(self, out: torch.Tensor, y: torch.Tensor, group, sp: int) -> None:
        """Replace every saved view of `out` (the core's output, [B, T, H/SP, D], the whole of its
        storage) by its rebuild from `y` = _heads_to_seq(out); anything else stays saved as is."""
        boxes, self.boxes = self.boxes, []
        b, t, h, d = y.shape
        storage = out.untyped_storage()
        if (out.shape != (b, sp * t, h // sp, d) or not out.is_contiguous() or out.storage_offset()
                or storage.nbytes() != out.numel() * out.element_size()):
            return  # not the layout _heads_to_seq was given: keep the core's tensors
        alias, version = y.detach(), y._version  # detached: no cycle through y's autograd node
        for box in boxes:
            x = box[0]
            if x.dtype == out.dtype and x.untyped_storage().data_ptr() == storage.data_ptr():
                box[0] = functools.partial(_rebuild, alias, version, group, sp,
                                           (x.shape, x.stride(), x.storage_offset()))


def _rebuild(y: torch.Tensor, version: int, group, sp: int, view: tuple) -> torch.Tensor:
    """The core's output (the `view` of it that was saved) from y = _heads_to_seq(output): the
    inverse exchange, [B, T/SP, H, D] -> [B, T, H/SP, D]."""
    if y._version != version:
        raise RuntimeError("Ulysses attention: o_proj's input was modified in place after the forward; "
                           "the attention output its backward needs cannot be rebuilt from it")
    b, t, h, d = y.shape
    x = y.reshape(b, t, sp, h // sp, d).permute(2, 0, 1, 3, 4).contiguous()  # [SP (head chunk), B, t, H/SP, D]
    got = torch.empty_like(x)
    dist.all_to_all_single(got, x, group=group)  # [SP (sequence chunk), B, t, H/SP, D]
    out = got.permute(1, 0, 2, 3, 4).reshape(b, sp * t, h // sp, d)
    return out.as_strided(*view)


def peer_groups(size: int, num_learners: int, lrank: int, *, timeout_s: float, field: str) -> Peers:
    """This learner's peers: groups of `size` consecutive learner ranks (hpc_tba.config.topology's
    replicas). Every learner rank calls it: it makes every group, in order, with the learners'
    collective timeout."""
    if size < 1 or num_learners % size:
        raise ValueError(f"learner.{field}={size} must divide the {num_learners} learner ranks")
    leader = lrank - lrank % size
    if size == 1:
        return Peers(1, 0, None, leader)
    mine = None
    for first in range(0, num_learners, size):
        g = dist.new_group(list(range(first, first + size)), timeout=datetime.timedelta(seconds=timeout_s))
        if first == leader:
            mine = g
    return Peers(size, lrank - leader, mine, leader)


def build(sp_size: int, num_learners: int, lrank: int, *, timeout_s: float) -> SequenceParallel:
    """This learner's SP layout; every learner rank calls it (peer_groups)."""
    p = peer_groups(sp_size, num_learners, lrank, timeout_s=timeout_s, field="sequence_parallel_size")
    return SequenceParallel(p.size, p.rank, p.group, p.leader)


def check_split(config, size: int) -> None:
    """Refuse, by name, a model Ulysses cannot split exactly over `size` ranks (a transformers
    config; the planner's dry run asks too)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    impl = getattr(config, "_attn_implementation", None)
    where = f"learner.sequence_parallel_size={size}"
    if impl not in _CORES + (ATTENTION,):
        raise ValueError(f"{where} needs sdpa or flash attention, but the model runs "
                         f"attn_implementation={impl!r} (a masked attention cannot be split)")
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    if heads % size or kv % size:
        raise ValueError(f"{where} must divide the model's {heads} attention heads and {kv} "
                         "key/value heads (Ulysses gives every SP rank whole heads)")


def enable(model, sp: SequenceParallel) -> None:
    """Switch `model` (a transformers causal LM) to Ulysses attention over `sp`'s group; refuses,
    by name, what the split cannot do exactly (check_split)."""
    if not sp.enabled:
        return
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    check_split(config, sp.size)
    if impl == ATTENTION:
        return
    if _STATE.get("core", impl) != impl:
        raise ValueError(f"learner.sequence_parallel_size={sp.size}: the policy and the reference "
                         "run different attentions")
    from transformers import AttentionInterface

    _STATE.update(group=sp.group, core=impl)
    AttentionInterface.register(ATTENTION, ulysses_attention)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for c in {id(config): config, id(text): text}.values():
        c._attn_implementation = ATTENTION

_SHARD_OWNED = ("loss/", "samples/", "buffer/")
"""Metrics a follower (SP or TP) does not report: summed ones (its leader reports the replica's
share) and those of the buffer shard it does not hold."""


def step_metrics(sp: Peers, metrics: dict[str, float], device) -> dict[str, float]:
    """A step's metrics with the same keys on every peer: the leader's key set (an empty
    shard reports fewer buffer keys), NaN on a follower where its leader speaks for the replica
    (comm.metrics reduces over the ranks that have a value)."""
    if not sp.enabled:
        return metrics
    box = [sorted(metrics) if sp.is_leader else None]
    dist.broadcast_object_list(box, src=sp.leader, group=sp.group, device=device)
    if sp.is_leader:
        return metrics
    nan = float("nan")
    return {k: nan if k.startswith(_SHARD_OWNED) else metrics.get(k, nan) for k in box[0]}
