"""Learner tensor parallelism: DeepSpeed AutoTP inside a node (`learner.tensor_parallel_size`).

Layout (hpc_tba.config.topology): the L learner ranks form D = L / TP data-parallel replicas of TP
consecutive ranks on one node, exactly like sequence parallelism's replicas (roles.parallel.Peers):
the replica's leader (TP rank 0) owns the buffer shard and broadcasts each step's batch to its TP
peers, which run the same micro-batches in lockstep on the whole sequences. DeepSpeed builds its
own dp x tp mesh (`groups._init_tp_mesh_device`, tp innermost), whose TP groups are these same
consecutive ranks: `check_engine` reads them back.

Split (`ds_section`, our partition config, never DeepSpeed's heuristics, presets or the model's
transformers TP plan): q, k, v, gate and up projections column-parallel, o and down row-parallel
(one all-reduce after each), every other parameter replicated: embeddings, norms and the output
head. transformers' Llama plan makes lm_head vocabulary-parallel, but the chunked log-prob head
(roles.policy) takes its log-softmax over `head.weight`: a vocabulary slice would normalise over
part of the vocabulary, so the head is a SKIP spec and `vocab_parallel_lm_head` is false, and
`check_engine` asserts the head holds the whole vocabulary. `strict_mode`: a Linear no spec names
(fused qkv, GPT-2's Conv1D, a router) is refused; so is any parameter inside attention that is not
a split projection (Qwen3's q_norm/k_norm would be replicated over sharded heads: `check_model`).

ZeRO-3: the model is built under zero.Init (every parameter partitioned over all L ranks); AutoTP
gathers each split weight, keeps this rank's TP slice as an ordinary parameter, and ZeRO-3
partitions that slice over the DP group (the D ranks of this TP index); replicated parameters
stay partitioned over all L ranks.

Gradients: every TP peer computes the replica's whole loss. A split parameter's gradient is its
slice's gradient of that loss, averaged over the DP group (D ranks); a replicated parameter's
gradient is the same on every TP peer (the column-parallel backward all-reduces the input
gradient), averaged over all L ranks: both equal (1/D) Σ_replicas ∇. So the learner's loss
normaliser is N / D (`grad_ranks`), N the step's loss units counted once per replica.

Full weights (weight sync, export): `gathered(params)` (it lives in hpc_tba.checkpoint.store, whose
export uses it: plumbing below the roles), `zero.GatheredParameters` (the ZeRO-3 partitions of
each slice) around `GatherReplacedLayerParams` (the TP slices, all-gathered along the split
dimension); every TP rank takes part in the same gathers in the same order. `full_shape`: a
parameter's whole shape, for the manifest the searchers map.
"""
from __future__ import annotations

import torch

from hpc_tba.checkpoint.store import full_shape, gathered, split_layer
from hpc_tba.comm.weight_sync import WeightSender
from hpc_tba.comm.weight_sync.feeds import VERSIONS_HELD
from hpc_tba.roles.parallel import Peers, peer_groups

__all__ = ["COLUMN", "ROW", "TPWeightSender", "build", "check_engine", "check_model", "ds_section",
           "full_shape", "gathered", "grad_ranks", "split_layer"]

COLUMN = (r".*\.self_attn\.[qkv]_proj\.(weight|bias)$", r".*\.mlp\.(gate|up)_proj\.(weight|bias)$")
ROW = (r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$")
"""Parameter names AutoTP splits (Llama-style decoders: Llama, Mistral, Qwen2)."""


def ds_section(size: int) -> dict:
    """The DeepSpeed `tensor_parallel` section for `size` ranks: every option that changes what
    is computed written out (tests/test_tensor_parallel.py reads them back from the engine)."""
    head = {"patterns": [r"^lm_head\.weight$", r"^embed_out\.weight$"], "partition_type": "skip"}
    return {
        "autotp_size": size,
        "tp": {"tp_size": size, "tp_grain_size": 1},
        "tp_overlap_comm": False,
        "vocab_parallel_lm_head": False,  # the chunked head needs the whole vocabulary (docstring)
        "vocab_parallel_ce_backend": "torch",
        "keep_module_on_host": False,
        "preset_model": None,
        "partition_config": {
            "use_default_specs": False, "strict_mode": True,
            "layer_specs": [{"patterns": list(COLUMN), "partition_type": "column"},
                            {"patterns": list(ROW), "partition_type": "row"}, head]},
    }


def build(size: int, num_learners: int, lrank: int, *, timeout_s: float) -> Peers:
    """This learner's TP peers (the replica's consecutive ranks), every learner rank calling it.

    The groups are DeepSpeed's own: made here, once per process, with the learners' collective
    timeout (DeepSpeed's mesh would take torch's default, 10 min under NCCL), and handed to
    `deepspeed.utils.groups`, whose `_init_tp_mesh_device` then keeps them (it builds nothing
    when a TP group exists): the TP groups are our replicas (`peer_groups`), the data-parallel
    groups the ranks of one TP index, the layout of DeepSpeed's (dp, tp) mesh.
    """
    import datetime

    import torch.distributed as dist
    from deepspeed.utils import groups

    if size == 1:
        return peer_groups(1, num_learners, lrank, timeout_s=timeout_s, field="tensor_parallel_size")
    if groups._TENSOR_MODEL_PARALLEL_GROUP is None:
        peers = peer_groups(size, num_learners, lrank, timeout_s=timeout_s, field="tensor_parallel_size")
        data = None
        for t in range(size):
            ranks = list(range(t, num_learners, size))
            g = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
            data = g if lrank in ranks else data
        groups._DATA_PARALLEL_GROUP = data
        groups._TENSOR_MODEL_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = peers.group
        return peers
    group = groups._TENSOR_MODEL_PARALLEL_GROUP  # a second learner in this process: the same groups
    leader = lrank - lrank % size
    if dist.get_process_group_ranks(group) != list(range(leader, leader + size)):
        raise RuntimeError(f"learner.tensor_parallel_size={size}: this process already has TP groups "
                           f"of another layout ({dist.get_process_group_ranks(group)})")
    return Peers(size, lrank - leader, group, leader)


def grad_ranks(num_learners: int, size: int) -> int:
    """Ranks DeepSpeed averages gradients over, as seen by the loss: D = L / TP (docstring)."""
    return num_learners // size


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_model(model, size: int) -> None:
    """Refuse, by name, a model AutoTP cannot split exactly with our specs over `size` ranks
    (before deepspeed.initialize, so every rank refuses before any collective)."""
    import re

    where = f"learner.tensor_parallel_size={size}"
    cfg = _text_config(model.config)
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if heads % size or kv % size:
        raise ValueError(f"{where} must divide the model's {heads} attention heads and {kv} key/value "
                         "heads (AutoTP gives every TP rank whole heads)")
    head = model.get_output_embeddings()
    whole = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    whole |= set() if head is None else {id(head.weight)}  # replicated 2-D weights: embeddings, head
    matched = 0
    for name, p in model.named_parameters():
        if any(re.match(pat, name) for pat in COLUMN + ROW):
            matched += 1
            continue
        two_d = len(getattr(p, "ds_shape", p.shape)) == 2
        if ".self_attn." in name or (two_d and id(p) not in whole):
            raise ValueError(f"{where}: {type(model).__name__} (model_type {cfg.model_type!r}) has "
                             f"{name}, which the learner's AutoTP split (q/k/v/o and gate/up/down "
                             "projections) does not cover exactly; this model family is not supported "
                             "with tensor parallelism")
    if not matched:
        raise ValueError(f"{where}: {type(model).__name__} has no q/k/v/o or gate/up/down projections "
                         "for AutoTP to split")


def check_engine(engine, peers: Peers, *, vocab_size: int) -> None:
    """Read back what DeepSpeed built: its TP group is our peers' ranks, every split projection
    is a column or row layer, the output head is whole (full vocabulary) and replicated."""
    import torch.distributed as dist
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer
    from deepspeed.utils import groups

    where = f"learner.tensor_parallel_size={peers.size}"
    ranks = dist.get_process_group_ranks(groups.get_tensor_model_parallel_group())
    if ranks != list(range(peers.leader, peers.leader + peers.size)):
        raise RuntimeError(f"{where}: DeepSpeed's TP group is ranks {ranks}, not this replica's "
                           f"{peers.leader}..{peers.leader + peers.size - 1}")
    module = engine.module
    kinds = {type(m) for m in module.modules() if hasattr(m, "tp_world_size")}
    if kinds != {LinearLayer, LinearAllreduce}:
        raise RuntimeError(f"{where}: AutoTP built {sorted(k.__name__ for k in kinds)}, expected "
                           "exactly column (LinearLayer) and row (LinearAllreduce) layers")
    head = module.get_output_embeddings()
    if type(head) is not torch.nn.Linear or tuple(head.weight.ds_shape)[0] != vocab_size:
        raise RuntimeError(f"{where}: the output head is {type(head).__name__} of shape "
                           f"{tuple(getattr(head.weight, 'ds_shape', head.weight.shape))}: it must stay "
                           f"a whole, replicated Linear over the {vocab_size}-token vocabulary")


class TPWeightSender(WeightSender):
    """The weight sender over a TP model: each bucket's parameters are gathered whole
    (`gathered`: ZeRO-3, then TP) on every learner rank, and rank 0 packs them; the manifest's
    shapes are the whole parameters' (`full_shape`), so searchers receive what a TP=1 learner
    sends."""

    def __init__(self, module: torch.nn.Module, manifest, group, *, device: str = "cpu",
                 versions_held: int = VERSIONS_HELD):
        super().__init__(module, manifest, group, device=device, direct_gather=False,
                         versions_held=versions_held)

    def _gather(self, params: list[torch.nn.Parameter], slot: int, flat: torch.Tensor, *,
                pack: bool, ready=None) -> None:
        with gathered(params):
            off = 0
            for p in params if pack else ():
                n = p.numel()
                flat[off: off + n].view(p.shape).copy_(p.data.detach())
                off += n
