"""`hpc-tba plan --dry-run`: the plan checked against the roles' own code on a meta-device model.

Why: the planner's arithmetic (hpc_tba.plan.memory) is a model of what the learner and the searchers
allocate; if it drifts from their code (another bucket rule, a micro-batch that packs more rows),
the plan is wrong exactly where it matters. The dry run builds the real model on the meta device
(shapes and dtypes, no storage: a 70B model in a second) and runs on it the code the roles run:

- the weight-sync manifest (`Manifest.build` with the learner's arguments) and the sender's two
  staging slots (`WeightSender` allocates them on the model's device, meta here); with
  out-of-process engines, its held copies (`HeldVersions.alloc`) and, on GPUs, each feed's two
  device pieces (`feeds.device_pieces`);
- the learner's micro-batch split (`roles.microbatch.plan`, or `plan_tokens` under a token
  budget) of a worst-case step (G x K sequences of max_model_len tokens) and its packing
  (`roles.policy.pack`) of each micro-batch;
- the receiver's staging (`staging_bytes`, `resolve_staging`: auto is stream; nothing out of
  process, where the receiver only decides);
- out-of-process engines: each worker's receiving buffers (`engine.worker_sync.worker_sync_bytes`
  on the real manifest and the model's largest layer) against the plan's row;
- the export's layer groups (`checkpoint.layer_groups`: the most any rank gathers at the end).

Each figure is printed next to the plan's and a mismatch is a problem (the plan is refused).

The model config: `model.path/config.json` when it exists (the real model's own config, read by
transformers' AutoConfig), otherwise a transformers config of the planner's architecture (a
`--arch`, or the known model named in the path: for the 70B preset a Llama-3.1-70B-shaped
LlamaConfig). Only shapes matter on the meta device, so rope and norm settings keep their
defaults. Runs on CPU in seconds.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from hpc_tba.plan.memory import DTYPE_BYTES, GiB, ModelSpec, Plan

if TYPE_CHECKING:
    from hpc_tba.config import RunConfig


def hf_config(cfg: RunConfig, spec: ModelSpec):
    """The transformers config of the model (module docstring: config.json, else the spec)."""
    from transformers import AutoConfig

    path = Path(cfg.model.path)
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(str(path)), f"{path}/config.json"
    kw = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
              intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
              num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
              tie_word_embeddings=spec.tie_embeddings, max_position_embeddings=cfg.searcher.max_model_len)
    if spec.head_dim_override:
        kw["head_dim"] = spec.head_dim_override
    if spec.model_type == "llama":
        kw["attention_bias"] = spec.qkv_bias
    return AutoConfig.for_model(spec.model_type, **kw), f"{spec.model_type} config of {spec.name}"


def meta_model(cfg: RunConfig, spec: ModelSpec):
    """The policy on the meta device in the learner's dtype."""
    from transformers import AutoModelForCausalLM

    config, source = hf_config(cfg, spec)
    dtype = torch.bfloat16 if cfg.learner.dtype == "bf16" else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, source


def _check(plan: Plan, label: str, planned, actual, unit: str = "", *, bound: bool = False) -> None:
    """One row: the plan's figure, the code's figure, and a problem when they differ (`bound`:
    when the code's exceeds the plan's, which is then an upper bound)."""
    def fmt(x):
        return f"{x / GiB:.3f} GiB" if unit == "GiB" else f"{x}"

    ok = actual <= planned if bound else planned == actual
    plan.lines.append(f"    {label:<44} plan {fmt(planned):>14}  code {fmt(actual):>14}  "
                      f"{'ok' if ok else 'MISMATCH'}")
    if not ok:
        plan.problems.append(f"dry run: {label}: the plan says {fmt(planned)}, the code "
                             f"{fmt(actual)} (the planner's model of the roles is out of date)")


def _manifest(plan: Plan, cfg: RunConfig, model) -> object:
    from hpc_tba.comm.weight_sync import Manifest, WeightSender
    from hpc_tba.config import resolve_wire_dtype

    lr = dataclasses.replace(cfg.learner, sync_wire_dtype=resolve_wire_dtype(cfg.learner, cfg.searcher))
    # the learner's call (roles/learner.py), on the meta parameters
    manifest = Manifest.build(
        [(n, tuple(getattr(p, "ds_shape", p.shape))) for n, p in model.named_parameters()],
        bucket_bytes=int(lr.sync_bucket_mb * 2**20), wire_dtype=lr.sync_wire_dtype)
    item = torch.empty((), dtype=manifest.dtype).element_size()
    sizes = [manifest.bucket_numel(b) * item for b in range(len(manifest.buckets))]
    _check(plan, "weight-sync bytes per version", sum(plan.buckets), manifest.total_bytes, "GiB")
    _check(plan, "weight-sync buckets", len(plan.buckets), len(sizes))
    _check(plan, "largest bucket", max(plan.buckets), max(sizes), "GiB")
    sender = WeightSender(model, manifest, None, device="meta", versions_held=lr.sync_versions_held)
    sender._free_slot(0, 0)  # allocates both staging slots, as the first send does
    slots = sum(s.numel() * s.element_size() for s in sender._slots)
    _check(plan, "sender staging slots (learner rank 0)", plan.terms["send_slots"], slots, "GiB")
    if plan.terms.get("held_versions"):  # out-of-process engines: the feeds' held copies
        from hpc_tba.comm.weight_sync.feeds import device_pieces

        for i in range(sender.held.count):
            sender.held.alloc(i)  # what each version's `begin` allocates at its first use
        _check(plan, "held versions (learner rank 0's node, host)", plan.terms["held_versions"],
               sender.held.allocated_bytes, "GiB")
        per_feed = sum(t.numel() * t.element_size() for t in device_pieces(manifest, "meta"))
        _check(plan, "feed device pieces (learner rank 0)", plan.terms["feed_buckets"],
               per_feed * cfg.cluster.num_searchers * bool(cfg.cluster.gpus_per_node), "GiB")
    return manifest


def _micro_batches(plan: Plan, cfg: RunConfig) -> None:
    from hpc_tba.roles import microbatch, parallel
    from hpc_tba.roles.policy import pack

    s, g, k = cfg.searcher, cfg.learner.prompts_per_step, cfg.searcher.k
    prompt_len, resp_len = s.max_model_len - s.max_new_tokens, s.max_new_tokens
    lengths = np.full(g * k, prompt_len + resp_len)
    groups = np.repeat(np.arange(g), k)
    budget = cfg.learner.micro_batch_tokens
    split = microbatch.plan_tokens(lengths, groups, budget) if budget else \
        microbatch.plan(lengths, groups, cfg.learner.micro_batch_size or k)
    prompt, response = np.zeros(prompt_len, dtype=np.int64), np.zeros(resp_len, dtype=np.int64)
    # every SP rank's positions on the meta device (roles.parallel: the split the learner runs; SP 1:
    # all of them); the windows must tile the padded sequence
    size = cfg.learner.sequence_parallel_size
    peers = [parallel.SequenceParallel(size, r, None, 0) for r in range(size)]
    shapes = []
    for rows in split.rows:
        batch = pack([prompt] * len(rows), [response] * len(rows), pad_id=0, packing=bool(budget))
        ids = batch.select(torch.arange(len(rows))).input_ids.to("meta")  # packed: the bin's rows
        windows = [sp.local_inputs(ids) for sp in peers]
        stops = [0] + [stop for _, _, stop in windows]
        if [start for _, start, _ in windows] != stops[:-1] or stops[-1] < ids.shape[1]:
            plan.problems.append(f"dry run: sequence parallel {size}: the ranks' windows "
                                 f"{[(a, b) for _, a, b in windows]} do not tile the "
                                 f"{ids.shape[1]} positions of a sequence (roles/parallel.py)")
        shapes.append(tuple(windows[0][0]["input_ids"].shape))
    plan.lines.append(f"    micro-batches of a worst-case step ({g} x {k} sequences of "
                      f"{s.max_model_len} tokens): {len(shapes)} x {shapes[0]}"
                      f"{'' if len(set(shapes)) == 1 else f' .. {shapes[-1]}'}")
    tokens = max(math.prod(x) for x in shapes)
    if budget:  # packed bins: the budget bounds every step's bins, whatever its sequences' lengths
        _check(plan, "tokens in the largest packed micro-batch (<=)", plan.micro_batch_tokens, tokens, bound=True)
        return
    _check(plan, "sequences in the largest micro-batch", plan.micro_batch, max(len(r) for r in split.rows))
    _check(plan, "tokens in the largest micro-batch (per SP rank)", plan.micro_batch_tokens, tokens)


def _staging(plan: Plan, cfg: RunConfig, manifest) -> None:
    from hpc_tba.comm.weight_sync import resolve_staging, staging_bytes

    c, s = cfg.cluster, cfg.searcher
    device = "cuda" if c.gpus_per_node else "cpu"
    mode = resolve_staging(s.staging, device, manifest, update=s.update)
    if s.engine_process:
        mode = "stream"  # WeightReceiver.serve_engine: what the engine's workers do
    _check(plan, f"searcher.staging={s.staging} resolves to", plan.staging, mode)
    planned = plan.terms["staging_device"] + plan.terms["staging_host"]
    # out of process the receiver only decides (serve_engine): the workers receive
    code = 0 if s.engine_process else staging_bytes(manifest, mode)
    _check(plan, f"receiver staging ({mode})", planned, code, "GiB")


def _workers(plan: Plan, cfg: RunConfig, manifest, layer_bytes: int) -> None:
    """Out-of-process engines: each worker's receiving buffers (engine.worker_sync's own bound on
    the manifest the learner builds), against the plan's row."""
    from hpc_tba.engine.worker_sync import worker_sync_bytes

    if not cfg.searcher.engine_process:
        return
    _check(plan, "engine worker sync buffers (each worker)", plan.terms["sync_worker"],
           worker_sync_bytes(manifest, layer_bytes, host=not cfg.cluster.gpus_per_node), "GiB")


def dry_run(plan: Plan, cfg: RunConfig, spec: ModelSpec) -> None:
    """Append the dry run's rows (and any mismatch as a problem) to `plan`."""
    from hpc_tba.checkpoint import store as checkpoint

    model, source = meta_model(cfg, spec)
    plan.lines.append(f"  dry run on the meta device ({source}, {cfg.learner.dtype}):")
    params = sum(p.numel() for p in model.parameters())
    _check(plan, "parameters", spec.params, params)
    pb = DTYPE_BYTES[cfg.learner.dtype]
    largest = max(sum(p.numel() for _, p in ps) for _, ps in checkpoint.layer_groups(model))
    _check(plan, "largest layer (export gather)", spec.largest_layer_params * pb, largest * pb, "GiB")
    if cfg.cluster.num_searchers:
        manifest = _manifest(plan, cfg, model)
        _staging(plan, cfg, manifest)
        _workers(plan, cfg, manifest, largest * manifest.dtype.itemsize)
    _micro_batches(plan, cfg)
    if cfg.learner.sequence_parallel_size > 1:  # the learner's own refusal, on the model's config
        from hpc_tba.roles import parallel

        try:
            parallel.check_split(model.config, cfg.learner.sequence_parallel_size)
            plan.lines.append(f"    sequence parallel {cfg.learner.sequence_parallel_size}: heads split "
                              f"exactly ({model.config._attn_implementation} attention)")
        except ValueError as e:
            plan.problems.append(f"dry run: {e}")
    if cfg.learner.tensor_parallel_size > 1:
        _tensor_parallel(plan, cfg, spec, model)


def _tensor_parallel(plan: Plan, cfg: RunConfig, spec: ModelSpec, model) -> None:
    """The learner's AutoTP refusal (roles.tensor_parallel.check_model) and its split patterns
    on the meta model: one TP rank's share of the largest decoder layer against the plan's."""
    import re

    from hpc_tba.checkpoint import store as checkpoint
    from hpc_tba.roles import tensor_parallel

    tp = cfg.learner.tensor_parallel_size
    try:
        tensor_parallel.check_model(model, tp)
    except ValueError as e:
        plan.problems.append(f"dry run: {e}")
        return
    split = tensor_parallel.COLUMN + tensor_parallel.ROW
    layers = [ps for name, ps in checkpoint.layer_groups(model) if name.split(".")[-1].isdigit()]
    per_rank = max(sum(p.numel() // tp if any(re.match(r, n) for r in split) else p.numel() for n, p in ps)
                   for ps in layers)
    _check(plan, f"decoder layer on one TP rank (TP {tp})", spec.split_layer_params(tp), per_rank)
    plan.lines.append(f"    tensor parallel {tp}: q/k/v/o and gate/up/down split, heads exact, "
                      "embeddings, norms and head replicated")
