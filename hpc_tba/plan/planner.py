"""Plan a run before it is queued: nodes and GPUs per role, per-GPU memory, and a verdict.

Why: a 70B job that dies of OOM after two hours in the queue costs a day. The planner uses the same
`Topology` the ranks build and reads the fields the learner and the searchers use, so a layout it
accepts is the layout srun starts with the settings the roles apply, and it refuses a config that
cannot fit, naming the term that does not.

Learner, per rank, ZeRO-3 over N learner ranks (P parameters, bytes per parameter in brackets):
  parameters [2 bf16 | 4 fp32] P/N, gradients [4: summed across micro-batches in fp32, the
  learner's data_types.grad_accum_dtype, also in bf16 runs] P/N, optimizer [12 bf16: fp32 master + Adam
  m, v | 8 fp32: m, v] P/N (`learner.offload_optimizer` / `offload_params` move them to host
  memory), a frozen reference [2|4] P/N when the loss needs one (its registration,
  `losses.registry.needs(cfg.algo).reference`;
  its forward runs without gradients, before the policy's, so only its shards add up), gathered
  layers (the live layer, the prefetched one and the live layer's full gradient: 3 x largest
  layer), ZeRO-3's flat gradient reduce bucket (reduce_bucket_size elements, at most P), the
  activations of one micro-batch of `learner.micro_batch_size` (0 = K) sequences of up to
  `searcher.max_model_len` tokens (a prompt of at most max_model_len - max_new_tokens plus a
  response of at most max_new_tokens), with or without `learner.gradient_checkpointing`, and
  one chunk of logits (`learner.logprob_chunk_tokens` positions): see hpc_tba.plan.memory for both
  counts. Sequence parallelism (`learner.sequence_parallel_size` = SP, hpc_tba.roles.parallel)
  gives each rank ceil(max_model_len / SP) positions of every sequence: the activation and logit
  rows count those (the all-to-all buffers are one layer's q, k, v and output, inside the
  per-layer figure's order of magnitude). Tensor parallelism (`learner.tensor_parallel_size` =
  TP, hpc_tba.roles.tensor_parallel) divides the split layers: the gathered layers' projections
  and the heads' and MLP's activations are / TP (hpc_tba.plan.learner states what is not).
  A refusal for one sequence's activations names the smallest SP and the smallest TP that fit.
  Learner rank 0 also holds the weight sender's two slots of the largest bucket. Usable: 90% of
  the GPU (CUDA context, NCCL buffers, fragmentation). The learner's rows: hpc_tba.plan.learner.
Engine, per GPU: weights P x bytes / TP, a fixed runtime overhead, and the KV cache in what is
  left of gpu_memory_utilization x GPU; 2 x layers x kv_heads x head_dim x bytes per token / TP.
  Refused when the weights do not fit or the cache cannot hold one max_model_len sequence (vLLM
  refuses to start then); fewer concurrent sequences than a round asks for is only a warning.
Checkpoint (hpc_tba.plan.checkpoint): a save's size, footprint on the shared filesystem and time
  at `cluster.checkpoint_gb_per_s`; a USR1 grace shorter than a save is refused.
Weight staging, per searcher (`searcher.staging`, hpc_tba.plan.memory.staging_bytes): outside vLLM's
  share, i.e. in 90% of (1 - gpu_memory_utilization) x GPU, or in host memory per node. `auto`
  is stream (comm.weight_sync.resolve_staging: a few buckets, never a version). Out-of-process
  engines: nothing in the searcher's process; each engine worker receives the broadcast itself
  (engine.worker_sync: max(3 buckets, a layer + a bucket) per worker, on its device; in host
  memory a layer + 3 buckets, two of them pooled).

The ZeRO-3 model-state figure is printed next to DeepSpeed's own estimator
(`estimate_zero3_model_states_mem_needs*`, which budgets 18 bytes/param and a 1.5x CPU factor).
`--dry-run` also builds the model on the meta device and runs the learner's and the sender's own
code on it (hpc_tba.plan.dryrun), checking the plan's shapes and sizes against theirs.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_tba.plan.checkpoint import checkpoint_rows, grace_refusal
from hpc_tba.plan.learner import learner_rows, micro_batch_of
from hpc_tba.plan.memory import (
    DTYPE_BYTES,
    KNOWN_MODELS,
    ModelSpec,
    Plan,
    bucket_sizes,
    spec_from_hf_config,
    staging_bytes,
)
from hpc_tba.plan.nccl import engine_bytes as engine_nccl_bytes
from hpc_tba.plan.sync import sync_rows

if TYPE_CHECKING:
    from hpc_tba.config import RunConfig

__all__ = ["KNOWN_MODELS", "ModelSpec", "Plan", "PlanOptions", "check_grace", "format_plan",
           "make_plan", "micro_batch_of", "model_spec", "plan_main"]

GiB = 2**30
USABLE_FRACTION = 0.9
ENGINE_OVERHEAD_GIB = 3.0


def model_spec(cfg: RunConfig, arch: str | None = None) -> ModelSpec:
    """The architecture: --arch, else the path's config.json, else a known name in the path."""
    m = cfg.model
    if arch:
        if arch not in KNOWN_MODELS:
            raise ValueError(f"unknown --arch {arch!r}; known: {', '.join(KNOWN_MODELS)}")
        return KNOWN_MODELS[arch]
    if m.path == "embedded":
        return _embedded_spec(cfg)
    config_json = Path(m.path) / "config.json"
    if config_json.is_file():
        return spec_from_hf_config(Path(m.path).name, json.loads(config_json.read_text()))
    key = Path(m.path).name.lower().replace("meta-", "")
    for name, spec in KNOWN_MODELS.items():
        if name in key:
            return spec
    raise ValueError(f"cannot tell the architecture of model.path={m.path!r}: no config.json "
                     f"there and no known name in it; pass --arch ({', '.join(KNOWN_MODELS)})")


def _embedded_spec(cfg: RunConfig) -> ModelSpec:
    """The tiny char-level Llama: its config.json once built, else the recipe of tasks.embedded."""
    from hpc_tba.config import TaskConfig
    from hpc_tba.models import tiny
    from hpc_tba.tasks.embedded import embedded_model_dir

    m = cfg.model
    built = embedded_model_dir(m, cfg.task if cfg.task.name == "arithmetic" else TaskConfig())
    if (built / "config.json").is_file():
        return spec_from_hf_config("embedded", json.loads((built / "config.json").read_text()))
    return ModelSpec("embedded", len(tiny.SPECIALS) + len(tiny.ALPHABET), m.hidden_size, 2 * m.hidden_size,
                     m.num_layers, m.num_heads, m.num_heads)


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """Flags of `hpc-tba plan` (every memory setting comes from the config)."""

    arch: str | None = None
    """Architecture by name (hpc_tba.plan.memory.KNOWN_MODELS) when model.path does not tell it."""
    deepspeed: bool = True
    """Print DeepSpeed's own ZeRO-3 estimate next to ours."""
    dry_run: bool = False
    """Build the model on the meta device and check the plan against the roles' own code."""


def _engine(plan: Plan, cfg: RunConfig, spec: ModelSpec, gpus: int) -> None:
    s, c = cfg.searcher, cfg.cluster
    tp = s.tensor_parallel_size
    wb = 2 if s.dtype in ("bfloat16", "float16", "half") else 4
    plan.lines.append(f"  searcher engine, per GPU (TP {tp}, {s.dtype}):")
    weights = plan.row(f"weights / TP {tp}", spec.params * wb / tp)
    if not gpus:
        kv = s.kv_cache_mb * 2**20
        plan.row("KV cache (searcher.kv_cache_mb, host memory)", kv)
        plan.engine_gib = (weights + kv) / GiB
        return
    budget = c.gpu_memory_gb * 1e9 * s.gpu_memory_utilization
    overhead = plan.row("runtime overhead (activations, CUDA graphs)", ENGINE_OVERHEAD_GIB * GiB)
    kv = budget - weights - overhead
    per_token = spec.kv_bytes_per_token(wb) / tp
    seqs = int(max(kv, 0) // (per_token * s.max_model_len))
    want = s.prompts_per_round * s.samples_per_prompt
    plan.row(f"KV cache ({seqs} sequences of {s.max_model_len} tokens)", max(kv, 0))
    plan.engine_gib = (weights + overhead + max(kv, 0)) / GiB
    plan.lines.append(f"    {'budget':<44} {budget / GiB:9.2f} GiB  "
                      f"(gpu_memory_utilization {s.gpu_memory_utilization} of "
                      f"{c.gpu_memory_gb:g} GB)")
    if weights + overhead > budget:
        plan.problems.append(
            f"engine weights need {(weights + overhead) / GiB:.1f} GiB per GPU of a "
            f"{budget / GiB:.1f} GiB budget: raise searcher.tensor_parallel_size")
    elif seqs < 1:
        plan.problems.append(f"engine KV cache cannot hold one {s.max_model_len}-token sequence: "
                             "raise tensor parallelism or lower searcher.max_model_len")
    elif seqs < want:
        plan.warnings.append(f"a round asks for {want} concurrent sequences, the KV cache holds "
                             f"{seqs}: vLLM will queue the rest (throughput, not failure)")


def _wire(cfg: RunConfig) -> str:
    from hpc_tba.config import resolve_wire_dtype

    return resolve_wire_dtype(cfg.learner, cfg.searcher)


def _staging(plan: Plan, cfg: RunConfig, spec: ModelSpec, gpus: int) -> None:
    """The searchers' weight staging (hpc_tba.plan.memory.staging_bytes), outside vLLM's share."""
    s, c = cfg.searcher, cfg.cluster
    wire = _wire(cfg)
    version, bucket = sum(plan.buckets), max(plan.buckets)
    # what the receiver's resolve_staging compares with: 90% of the memory vLLM leaves free
    room = c.gpu_memory_gb * 1e9 * (1 - s.gpu_memory_utilization) * USABLE_FRACTION if gpus else 0.0
    # the receiver's resolve_staging: auto is stream (no process holds a whole version)
    mode = "stream" if s.staging == "auto" or s.engine_process else s.staging
    st = staging_bytes(mode, version_bytes=version, bucket_bytes=bucket)
    if s.engine_process:  # the engine's workers receive; the searcher's process holds no weights
        st = dataclasses.replace(st, device_bytes=0, host_bytes=0)
    plan.lines.append(f"  weight staging, per searcher (searcher.staging={s.staging} -> {mode}; "
                      f"{len(plan.buckets)} buckets of <= {bucket / 2**20:.0f} MiB, {wire} on the wire):")
    dev = "GPU, beside vLLM's share" if gpus else "host memory (no GPU)"
    plan.row(f"staging on the device ({dev})", st.device_bytes, key="staging_device")
    plan.row("staging in pinned host memory", st.host_bytes, key="staging_host")
    plan.staging = mode
    worker = _engine_workers(plan, cfg, spec, bucket, gpus)
    nccl = engine_nccl_bytes(cfg) if gpus else 0  # the weight-sync communicator (hpc_tba.plan.nccl)
    if nccl:
        plan.row("NCCL buffers, weight sync (beside vLLM's share)", nccl,
                 "one ring broadcast per engine GPU", key="nccl_engine")
    if gpus and max(st.device_bytes, worker) + nccl > room:
        plan.problems.append(
            f"searcher.staging={mode} needs {(max(st.device_bytes, worker) + nccl) / GiB:.1f} GiB on an engine GPU "
            f"beside vLLM's share, but {room / GiB:.1f} GiB are left ({USABLE_FRACTION:.0%} of "
            f"what gpu_memory_utilization {s.gpu_memory_utilization} leaves): use staging=host or "
            f"stream, a smaller learner.sync_bucket_mb, or lower searcher.gpu_memory_utilization")
    per_node = max(gpus // s.tensor_parallel_size, 1) if gpus else c.num_searchers
    host = (st.host_bytes + (0 if gpus else st.device_bytes + s.tensor_parallel_size * worker)) * per_node
    if c.host_memory_gb and host > c.host_memory_gb * 1e9 * USABLE_FRACTION:
        plan.problems.append(
            f"weight staging needs {host / GiB:.1f} GiB of host memory per searcher node "
            f"({per_node} searchers) of {c.host_memory_gb:g} GB: use searcher.staging=stream")


def check_grace(cfg: RunConfig) -> None:
    """Raise ValueError naming the save when a Slurm run's USR1 grace cannot hold a checkpoint:
    the sbatch generator and submitit's `launch` call it before anything is queued. A model whose
    shape cannot be told here (no config.json on this machine, no known name) is not checked."""
    if cfg.cluster.backend != "slurm":
        return
    try:
        spec = model_spec(cfg)
    except ValueError:
        return
    refusal = grace_refusal(cfg, spec)
    if refusal:
        raise ValueError(refusal)


def _engine_workers(plan: Plan, cfg: RunConfig, spec: ModelSpec, bucket: int, gpus: int) -> int:
    """Out-of-process engines: bytes per engine worker for the weight sync (engine.worker_sync):
    each worker receives the learner's broadcast itself, on its own device (GPU beside vLLM's
    share, host memory on CPU), bucket by bucket: two bucket buffers alive (one loaded, one
    received), three while vLLM's loader still holds both, or a whole layer and one bucket while
    its layer-wise reload waits for a layer's last tensor, plus, in host memory, the two pooled
    buffers' room over that layer's own tensors (worker_sync.worker_sync_bytes; the dry run
    checks the two agree). A skipped version drains into one of them."""
    s = cfg.searcher
    if not s.engine_process:
        return 0
    layer = spec.largest_layer_params * DTYPE_BYTES[_wire(cfg)]
    worker = max(3 * bucket, layer + bucket + (0 if gpus else 2 * bucket))
    plan.terms["worker_layer"] = layer
    where = "GPU, beside vLLM's share" if gpus else "host memory"
    plan.lines.append(f"  engine workers (engine_process, TP {s.tensor_parallel_size}) receive the "
                      f"broadcast themselves; the searcher's process holds no weights:")
    plan.row(f"weight-sync buffers per engine worker ({where})", worker, key="sync_worker")
    return worker


RUNTIME_HOST_GIB = 1.0
"""Host memory per rank process besides what the rows count (interpreter, torch, DeepSpeed or
vLLM libraries, buffers): the embedded run's largest process peaked at 0.9 GB (README)."""


def _host_rows(plan: Plan, cfg: RunConfig, topo) -> None:
    """Host memory per node kind (memory.NODE_KINDS) into plan.host_bytes, one line, and a refusal
    past cluster.host_memory_gb. GPU nodes: offloaded states, learner rank 0's held versions, the
    searchers' host staging; CPU nodes also hold what the GPU rows count (every row is host memory)."""
    c, s, lr = cfg.cluster, cfg.searcher, cfg.learner
    gpus, runtime = c.gpus_per_node, RUNTIME_HOST_GIB * GiB
    learners = sum(1 for r in topo.learner_ranks if topo.node_of(r) == 0)
    if gpus:
        pb, ob = DTYPE_BYTES[lr.dtype], 12 if lr.dtype == "bf16" else 8
        per_learner = (ob * lr.offload_optimizer + 2 * pb * lr.offload_params) * plan_params(plan)
    else:
        per_learner = plan.learner_gib * GiB
    learner = learners * (per_learner + runtime)
    plan.host_bytes = {"learner0": learner + plan.terms.get("held_versions", 0.0)}
    if topo.learner_nodes > 1:
        plan.host_bytes["learner"] = learner
    if c.num_searchers:
        engines = min(topo.engines_per_node, c.num_searchers)
        procs = 1 + (1 + s.tensor_parallel_size if s.engine_process else 0)
        per_engine = plan.terms.get("staging_host", 0.0) + procs * runtime
        if not gpus:  # the engine's weights, KV cache, staging and workers' buffers are host memory here
            per_engine += (plan.engine_gib * GiB + plan.terms.get("staging_device", 0.0)
                           + s.tensor_parallel_size * plan.terms.get("sync_worker", 0.0))
        plan.host_bytes["searcher"] = engines * per_engine
    names = {"learner0": "learner rank 0's node", "learner": "learner node", "searcher": "searcher node"}
    of = f" (of {c.host_memory_gb:g} GB cluster.host_memory_gb)" if c.host_memory_gb else ""
    plan.lines.append("  host memory per node: " + ", ".join(
        f"{names[k]} {v / GiB:.1f} GiB" for k, v in plan.host_bytes.items()) + of
        + f"; {RUNTIME_HOST_GIB:g} GiB per rank process included")
    cap = c.host_memory_gb * 1e9 * USABLE_FRACTION
    for kind, need in plan.host_bytes.items():
        if c.host_memory_gb and need > cap:
            plan.problems.append(f"a {names[kind]} needs {need / GiB:.1f} GiB of host memory, more than "
                                 f"{USABLE_FRACTION:.0%} of cluster.host_memory_gb={c.host_memory_gb:g} GB")


def plan_params(plan: Plan) -> float:
    """Parameters per learner rank's ZeRO-3 shard, from the plan's parameter row."""
    return plan.terms.get("params_per_rank", 0.0)


def make_plan(cfg: RunConfig, opt: PlanOptions = PlanOptions()) -> Plan:
    """Build the plan for a composed config; layout errors become problems."""
    from hpc_tba.config.topology import LayoutError, Topology

    plan, c = Plan(), cfg.cluster
    spec = model_spec(cfg, opt.arch)
    plan.lines.append(f"plan: {cfg.name}  model {spec.name}: {spec.params / 1e9:.2f} B params, "
                      f"largest layer {spec.largest_layer_params / 1e9:.3f} B")
    try:
        topo = Topology.for_run(cfg)
    except LayoutError as e:
        plan.problems.append(str(e))
        return plan
    gpus = c.gpus_per_node
    unit = f"{gpus} GPUs x {c.gpu_memory_gb:g} GB" if gpus else "CPU"
    plan.lines.append(f"  cluster: {c.nodes} node(s) x {unit}, {topo.world_size} ranks")
    plan.lines.append(f"  learner : {topo.learner_nodes} node(s), {c.num_learners} ranks"
                      f"{f' = {c.num_learners} GPUs' if gpus else ''}")
    plan.lines.append(f"  searcher: {topo.searcher_nodes} node(s), {c.num_searchers} engine(s) x "
                      f"TP {topo.tp_size}"
                      f"{f' = {c.num_searchers * topo.tp_size} GPUs' if gpus else ''}")
    plan.lines += [f"    {ln}" for ln in topo.describe().splitlines()] if topo.num_nodes <= 4 else []
    capacity = c.gpu_memory_gb * 1e9 * USABLE_FRACTION
    plan.buckets = bucket_sizes(spec, bucket_bytes=int(cfg.learner.sync_bucket_mb * 2**20),
                                wire_bytes=DTYPE_BYTES[_wire(cfg)])
    learner_rows(plan, cfg, spec, gpus, capacity, usable=USABLE_FRACTION, deepspeed=opt.deepspeed)
    if c.num_searchers:
        _engine(plan, cfg, spec, gpus)
        _staging(plan, cfg, spec, gpus)
        sync_rows(plan, cfg)
    checkpoint_rows(plan, cfg, spec)
    _host_rows(plan, cfg, topo)
    if opt.dry_run:
        from hpc_tba.plan.dryrun import dry_run

        dry_run(plan, cfg, spec)
    return plan


def format_plan(plan: Plan) -> str:
    verdict = ["FITS"] if plan.fits else ["REFUSED:"] + [f"  - {p}" for p in plan.problems]
    warn = [f"warning: {w}" for w in plan.warnings]
    return "\n".join(plan.lines + warn + verdict) + "\n"


def _parse(argv: list[str]) -> tuple[list[str], PlanOptions]:
    overrides, kw = [], {}
    it = iter(argv)
    for a in it:
        key, _, val = a.partition("=")
        if key == "--arch":
            kw["arch"] = val or next(it)
        elif a == "--dry-run":
            kw["dry_run"] = True
        elif a == "--no-deepspeed":
            kw["deepspeed"] = False
        elif key in _MOVED:
            raise ValueError(f"{key} is a config field now: pass {_MOVED[key]}")
        elif a.startswith("--"):
            raise ValueError(f"unknown option {a}")
        else:
            overrides.append(a)
    return overrides, PlanOptions(**kw)


_MOVED = {"--micro-batch": "learner.micro_batch_size=N",
          "--offload": "learner.offload_optimizer=true / learner.offload_params=true",
          "--no-activation-checkpointing": "learner.gradient_checkpointing=false"}


def plan_main(argv: list[str]) -> int:
    """`hpc-tba plan <overrides> [--arch A] [--dry-run] [--no-deepspeed]`: 0 fits, 1 refused,
    2 the config or an option is wrong. Memory settings are config overrides (learner.*)."""
    from hpc_tba.assembly.compose import compose
    from hpc_tba.config import ConfigError

    try:
        overrides, opt = _parse(list(argv))
        plan = make_plan(compose(overrides), opt)
    except (ConfigError, ValueError, StopIteration) as e:
        print(f"hpc-tba plan: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(format_plan(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(plan_main(sys.argv[1:]))
