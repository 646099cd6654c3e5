"""The planner's learner section (hpc_tba.plan.planner's docstring states the terms).

Tensor parallelism (`learner.tensor_parallel_size` = TP, hpc_tba.roles.tensor_parallel): the
model states stay P / N per rank (ZeRO-3 partitions each TP slice over the N / TP data-parallel
ranks: (P_split / TP) / (N / TP) = P_split / N; replicated parameters over all N), the gathered
layers are a layer's projections / TP plus its norms, and the activations of the heads and of
the MLP's intermediate width are / TP (the norms' full-width tensors and the checkpointed layer
inputs are not; the output head is replicated, so the logit chunk is not either).
"""
from __future__ import annotations

import contextlib
import io
import os
from typing import TYPE_CHECKING

from hpc_tba.losses.registry import needs
from hpc_tba.plan.memory import DTYPE_BYTES, ModelSpec, Plan, activation_bytes, logit_bytes
from hpc_tba.plan.nccl import learner_bytes as nccl_learner_bytes

if TYPE_CHECKING:
    from hpc_tba.config import RunConfig

GiB = 2**30


def micro_batch_of(cfg: RunConfig) -> int:
    """Sequences in one learner micro-batch: learner.micro_batch_size, 0 = K, at most G x K; with
    learner.micro_batch_tokens, the whole sequences of searcher.max_model_len one packed bin holds."""
    lr, k = cfg.learner, cfg.searcher.k
    if lr.micro_batch_tokens:
        return max(1, min(lr.micro_batch_tokens // cfg.searcher.max_model_len, lr.prompts_per_step * k))
    return min(lr.micro_batch_size or k, lr.prompts_per_step * k)


def micro_batch_positions(cfg: RunConfig, sp: int) -> int:
    """Token positions of the largest micro-batch on one rank: the token budget (packed rows),
    else micro-batch sequences x this SP rank's share of searcher.max_model_len."""
    if cfg.learner.micro_batch_tokens:
        return cfg.learner.micro_batch_tokens
    return micro_batch_of(cfg) * -(-cfg.searcher.max_model_len // sp)


def _gathered(spec: ModelSpec, tp: int, pb: int) -> float:
    """The live layer, the prefetched one and the live layer's full gradient, on one TP rank."""
    return 3 * max(spec.embedding_params, spec.split_layer_params(tp)) * pb


def _model_states(plan: Plan, cfg: RunConfig, spec: ModelSpec, n: int) -> float:
    lr = cfg.learner
    pb, ob, p = DTYPE_BYTES[lr.dtype], 12 if lr.dtype == "bf16" else 8, spec.params
    host = "(host memory)"
    plan.terms["params_per_rank"] = p / n  # the host rows' offloaded shards (planner._host_rows)
    total = plan.row("parameters (sharded)", pb * p / n * (not lr.offload_params),
                     host if lr.offload_params else "", key="params")
    gb = DTYPE_BYTES[_deepspeed(cfg)["data_types"]["grad_accum_dtype"]]  # ZeRO-3's partition buffer
    total += plan.row("gradients (sharded)", gb * p / n,
                      "fp32 accumulation" if gb != pb else "", key="grads")
    total += plan.row("optimizer states (sharded)", ob * p / n * (not lr.offload_optimizer),
                      host if lr.offload_optimizer else "", key="optimizer")
    plan.model_states_gib = total / GiB
    if needs(cfg.algo).reference:
        total += plan.row(f"frozen reference for {cfg.algo.name} (sharded)",
                          pb * p / n * (not lr.offload_params), key="reference")
    else:
        plan.terms["reference"] = 0
    tp = lr.tensor_parallel_size
    total += plan.row("gathered layers (live + prefetch + grad)", _gathered(spec, tp, pb),
                      f"projections / TP {tp}" if tp > 1 else "", key="gathered")
    # ZeRO-3 with contiguous gradients allocates one flat reduce bucket at initialize
    bucket = min(_zero_option(cfg, "reduce_bucket_size", 500_000_000), p)
    return total + plan.row("ZeRO-3 gradient reduce bucket", bucket * pb,
                            f"{bucket:.3g} elements (zero_optimization.reduce_bucket_size)", key="reduce_bucket")


def _zero_option(cfg: RunConfig, name: str, default: int) -> int:
    """A zero_optimization setting of the learner's own DeepSpeed config, else DeepSpeed's default."""
    return int(_deepspeed(cfg)["zero_optimization"].get(name, default))


def _deepspeed(cfg: RunConfig) -> dict:
    """The learner's own DeepSpeed config for this run."""
    from hpc_tba.roles.ds_config import deepspeed_config

    return deepspeed_config(cfg.learner, micro_batch=micro_batch_of(cfg), train=True)


def _activation_total(cfg: RunConfig, spec: ModelSpec, sp: int, tp: int):
    """(bytes, the activations, micro-batch sequences, positions per sequence) on one rank at
    sequence-parallel size sp and tensor-parallel size tp."""
    lr, s = cfg.learner, cfg.searcher
    b = micro_batch_of(cfg)
    seq = -(-s.max_model_len // sp)  # this rank's positions of one sequence (roles.parallel)
    act = activation_bytes(spec, tokens=micro_batch_positions(cfg, sp), dtype_bytes=DTYPE_BYTES[lr.dtype],
                           checkpointing=lr.gradient_checkpointing, tp=tp)
    return act.boundaries + act.live_layers, act, b, seq


def _activations(plan: Plan, cfg: RunConfig, spec: ModelSpec) -> float:
    lr, s = cfg.learner, cfg.searcher
    sp, tp = lr.sequence_parallel_size, lr.tensor_parallel_size
    total, act, b, seq = _activation_total(cfg, spec, sp, tp)
    plan.micro_batch, plan.micro_batch_tokens = b, micro_batch_positions(cfg, sp)
    src = "learner.micro_batch_size" if lr.micro_batch_size else "K (micro_batch_size 0)"
    shape = f"{b} x {seq} tokens ({src}"
    if lr.micro_batch_tokens:
        shape = f"{lr.micro_batch_tokens} tokens (learner.micro_batch_tokens, packed"
    rows = f"{spec.num_layers} layers x {shape}" + (
        f"; {s.max_model_len} / SP {sp})" if sp > 1 else f"; heads and MLP / TP {tp})" if tp > 1 else ")")
    if lr.gradient_checkpointing:
        plan.row("activations: layer inputs (checkpointing)", act.boundaries, rows)
        plan.row("activations: one layer recomputed", act.live_layers)
    else:
        plan.row("activations: every layer (no checkpointing)", act.live_layers, rows)
    plan.terms["activations"] = total
    responses = lr.micro_batch_tokens or b * -(-s.max_new_tokens // sp)  # packed: at most the budget
    chunk = min(lr.logprob_chunk_tokens, responses)
    return total + plan.row("logits: one chunk (+ fp32 log-softmax, grad)",
                            logit_bytes(spec, chunk_tokens=chunk, dtype_bytes=DTYPE_BYTES[lr.dtype]),
                            f"{chunk} positions x vocab {spec.vocab_size} (replicated head)", key="logits")


def learner_rows(plan: Plan, cfg: RunConfig, spec: ModelSpec, gpus: int, capacity: float, *,
                 usable: float, deepspeed: bool) -> None:
    """The learner's per-rank rows, its total and its refusal (if any) into `plan`."""
    c, lr = cfg.cluster, cfg.learner
    n = max(cfg.cluster.num_learners, 1)
    where = "GPUs" if gpus else "CPU ranks"
    par = f", sequence parallel {lr.sequence_parallel_size}" if lr.sequence_parallel_size > 1 else ""
    par += f", tensor parallel {lr.tensor_parallel_size}" if lr.tensor_parallel_size > 1 else ""
    plan.lines.append(f"  learner, per rank (ZeRO-{lr.zero_stage} over {n} {where}{par}, {lr.dtype}, "
                      f"checkpointing={lr.gradient_checkpointing}, offload optimizer="
                      f"{lr.offload_optimizer} params={lr.offload_params}):")
    tp = lr.tensor_parallel_size
    if spec.num_heads % tp or spec.num_kv_heads % tp:  # the learner's own refusal (check_model)
        plan.problems.append(f"learner.tensor_parallel_size={tp} must divide the model's {spec.num_heads} "
                             f"attention heads and {spec.num_kv_heads} key/value heads")
    total = _model_states(plan, cfg, spec, n) + _activations(plan, cfg, spec)
    # learner rank 0 gathers into two flat slots of the largest bucket (WeightSender)
    total += plan.row("weight-sync send slots (rank 0)", 2 * max(plan.buckets) * (c.num_searchers > 0),
                      f"2 x the largest bucket (learner.sync_bucket_mb {lr.sync_bucket_mb:g})", key="send_slots")
    total += _feed_rows(plan, cfg, gpus)
    if gpus:  # NCCL's own buffers (hpc_tba.plan.nccl); on CPU the groups are gloo's
        every, sync, note, sync_note = nccl_learner_bytes(cfg)
        total += plan.row("NCCL buffers (outside torch's allocator)", every, note, key="nccl")
        if sync:
            total += plan.row("NCCL buffers, weight sync (rank 0)", sync, sync_note, key="nccl_sync")
    plan.learner_gib = total / GiB
    if gpus:
        plan.lines.append(f"    {'total':<44} {total / GiB:9.2f} GiB  of {capacity / GiB:.2f} "
                          f"usable ({usable:.0%} of {c.gpu_memory_gb:g} GB)")
        if total > capacity:
            plan.problems.append(_learner_refusal(plan, cfg, spec, total, capacity))
    pb, ob = DTYPE_BYTES[lr.dtype], 12 if lr.dtype == "bf16" else 8
    per_rank = (ob * lr.offload_optimizer + 2 * pb * lr.offload_params) * spec.params / n
    held = plan.terms["held_versions"]
    if held and c.host_memory_gb and per_rank * max(gpus, 1) + held > c.host_memory_gb * 1e9 * usable:
        plan.problems.append(f"learner rank 0's node needs {(per_rank * max(gpus, 1) + held) / GiB:.1f} "
                             f"GiB of host memory (held versions {held / GiB:.1f} GiB"
                             f"{', offload' if per_rank else ''}) of {c.host_memory_gb:g} GB: lower "
                             f"learner.sync_versions_held (>= 1) or use bf16 on the wire")
    if per_rank and c.host_memory_gb:
        host = per_rank * max(gpus, 1)
        plan.lines.append(f"    host memory per node for offload: {host / GiB:.1f} GiB of "
                          f"{c.host_memory_gb * 1e9 / GiB:.1f}")
        if host > c.host_memory_gb * 1e9 * usable:
            plan.problems.append("offloaded optimizer states do not fit in host memory per node")
    if deepspeed:
        _compare_deepspeed(plan, spec, gpus, cfg)


def _feed_rows(plan: Plan, cfg: RunConfig, gpus: int) -> int:
    """Out-of-process engines' feeds on learner rank 0 (comm/weight_sync/feeds.py): the held
    copies of a version in its node's host memory (a line of its own), and on a GPU two device
    pieces per feed (one feed per searcher; `feeds.device_pieces`, the same piece size as the
    manifest's), returned for the device total."""
    from hpc_tba.comm.weight_sync.feeds import device_piece_numel, held_bytes
    from hpc_tba.comm.weight_sync.manifest import WIRE_PIECE_BYTES, piece_elements
    from hpc_tba.config import resolve_wire_dtype

    c, lr = cfg.cluster, cfg.learner
    feeds = c.num_searchers if cfg.searcher.engine_process else 0
    held = held_bytes(sum(plan.buckets), lr.sync_versions_held) if feeds else 0
    plan.terms["held_versions"] = held
    if not feeds:
        return 0
    plan.lines.append(f"    {'weight-sync held versions (rank 0 node, host)':<44} {held / GiB:9.2f} GiB  "
                      f"learner.sync_versions_held {lr.sync_versions_held} x the version, host memory")
    item = DTYPE_BYTES[resolve_wire_dtype(lr, cfg.searcher)]
    largest = max(plan.buckets) // item  # elements
    piece = device_piece_numel(piece_elements(WIRE_PIECE_BYTES, item, largest), largest) * item
    dev = 2 * piece * feeds if gpus else 0
    return plan.row("weight-sync feed pieces (rank 0)", dev,
                    f"2 x a {piece / 2**20:.0f} MiB piece x {feeds} out-of-process searchers" if gpus
                    else "(CPU: feeds broadcast the held copies)", key="feed_buckets")


def _learner_refusal(plan: Plan, cfg: RunConfig, spec: ModelSpec, total: float, capacity: float) -> str:
    """The reason a learner layout does not fit: the largest term and what would shrink it."""
    lr, t = cfg.learner, plan.terms
    head = f"learner needs {total / GiB:.1f} GiB per GPU but {capacity / GiB:.1f} GiB are usable"
    states = t["params"] + t["grads"] + t["optimizer"] + t["reference"]
    # activations are the lever when they are the larger term, or when shrinking them alone would fit
    if t["activations"] >= states or t["activations"] > total - capacity:
        knob = "learner.micro_batch_tokens" if lr.micro_batch_tokens else "learner.micro_batch_size"
        # a packed bin shrinks down to one whole sequence (searcher.max_model_len)
        room = lr.micro_batch_tokens > cfg.searcher.max_model_len if lr.micro_batch_tokens else plan.micro_batch > 1
        smaller = f" or lower {knob}" if room else ""
        if not lr.gradient_checkpointing:
            return (f"{head}: activations without gradient checkpointing take "
                    f"{t['activations'] / GiB:.1f} GiB (every layer of {plan.micro_batch_tokens} "
                    f"tokens): set learner.gradient_checkpointing=true{smaller}")
        size = f"{lr.micro_batch_tokens}-token packed" if lr.micro_batch_tokens else f"{plan.micro_batch}-sequence"
        what = f"{head}: activations of a {size} micro-batch take {t['activations'] / GiB:.1f} GiB"
        if room:
            return f"{what}: lower {knob}"
        packed = "set learner.micro_batch_tokens=0 (packing does not combine with SP) and " \
            if lr.micro_batch_tokens else ""
        return f"{what}: {packed}{_next_lever(cfg, plan, spec, total, capacity)}"
    return (f"{head}: model states take {states / GiB:.1f} GiB: add learner nodes, or offload "
            f"(learner.offload_optimizer=true, learner.offload_params=true)")


def _next_lever(cfg: RunConfig, plan: Plan, spec: ModelSpec, total: float, capacity: float) -> str:
    """The next lever for one sequence's activations (the micro-batch is already 1): the
    smallest sequence-parallel size that fits and the smallest tensor-parallel size that fits
    (each must divide the GPUs per node, the learners and the model's heads; they do not
    combine, so one is named with the other set back to 1), else what is left."""
    lr, gpus, t = cfg.learner, cfg.cluster.gpus_per_node, plan.terms
    pb = DTYPE_BYTES[lr.dtype]
    rest = total - t["activations"] - t["gathered"]

    def sizes(current: int) -> list[int]:
        return [k for k in range(current + 1, max(gpus, 1) + 1) if not (
            gpus % k or spec.num_heads % k or spec.num_kv_heads % k or cfg.cluster.num_learners % k)]

    def fits(sp: int, tp: int) -> bool:
        return rest + _activation_total(cfg, spec, sp, tp)[0] + _gathered(spec, tp, pb) <= capacity

    levers = []
    sp = next((k for k in sizes(lr.sequence_parallel_size) if fits(k, 1)), None)
    if sp:
        off = "learner.tensor_parallel_size=1 and " if lr.tensor_parallel_size > 1 else ""
        levers.append(f"set {off}learner.sequence_parallel_size={sp} (Ulysses: each of {sp} ranks holds "
                      f"1/{sp} of every sequence's activations)")
    tp = next((k for k in sizes(lr.tensor_parallel_size) if fits(1, k)), None)
    if tp:
        off = "learner.sequence_parallel_size=1 and " if lr.sequence_parallel_size > 1 else ""
        levers.append(f"set {off}learner.tensor_parallel_size={tp} (AutoTP: each of {tp} ranks holds "
                      f"1/{tp} of the heads' and the MLP's activations and projections)")
    if levers:
        return ", or ".join(levers)
    return ("neither sequence nor tensor parallelism within a node splits it enough (each is at most "
            f"the {gpus} GPUs per node, must divide the model's heads, and they do not combine): "
            "shorten searcher.max_model_len")


def _compare_deepspeed(plan: Plan, spec: ModelSpec, gpus: int, cfg: RunConfig) -> None:
    """Print DeepSpeed's own ZeRO-3 model-state estimate next to ours."""
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.runtime.zero.stage3 import (
                estimate_zero3_model_states_mem_needs,
                estimate_zero3_model_states_mem_needs_all_cold,
            )
    except Exception as e:  # noqa: BLE001 - the comparison is optional, the plan is not
        plan.lines.append(f"  DeepSpeed estimator unavailable: {type(e).__name__}: {e}")
        return
    per_node = gpus or 1
    nodes = max(cfg.cluster.num_learners // per_node, 1)
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
        total_params=spec.params, largest_layer_params=spec.largest_layer_params,
        num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=cfg.learner.offload_optimizer,
        cpu_offload_params=cfg.learner.offload_params, zero_init=True)
    plan.deepspeed_gib = ds_gpu / GiB
    ours = plan.model_states_gib + 4 * spec.largest_layer_params / GiB
    plan.lines.append(
        f"  ZeRO-3 model states per GPU: hpc_tba {ours:.2f} GiB (params+grads+optimizer, "
        f"+ 4 B x largest layer) vs DeepSpeed {plan.deepspeed_gib:.2f} GiB "
        f"(estimate_zero3_model_states_mem_needs, 18 B/param)")
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        estimate_zero3_model_states_mem_needs_all_cold(
            spec.params, spec.largest_layer_params, num_gpus_per_node=per_node, num_nodes=nodes)
    plan.lines += ["  DeepSpeed estimate_zero3_model_states_mem_needs_all_cold:"]
    plan.lines += [f"    {ln}".replace("OffloadDeviceEnum.", "")
                   for ln in table.getvalue().rstrip().splitlines()]
