"""Plan a run before it is queued: nodes and GPUs per role, per-GPU memory, and a verdict.

Why: a 70B job that dies of OOM after two hours in the queue costs a day. The planner uses the same
`Topology` the ranks build, so a layout it accepts is the layout srun starts, and it refuses a
config that cannot fit, naming the term that does not.

Learner, per GPU, ZeRO-3 over N learner GPUs (P parameters, bytes per parameter in brackets):
  parameters [2 bf16 | 4 fp32] P/N, gradients [same] P/N, optimizer [12 bf16: fp32 master + Adam
  m, v | 8 fp32: m, v] P/N (the optimizer, or the optimizer and the parameters, may be offloaded to
  CPU), a frozen reference [2|4] P/N for losses with a KL/importance term, gathered layers (the
  live layer, the prefetched one and the live layer's full gradient: 3 x largest layer x 2 bytes),
  activations (Korthikanti et al. 2022 with flash attention: 34 b T h bytes per layer; with
  activation checkpointing only each layer's input b T h x 2 bytes is kept plus one layer's
  recompute) and the logits of the micro-batch (b T V x 10 bytes: bf16 logits, fp32 copy and
  log-softmax). Usable: 90% of the GPU (CUDA context, NCCL buffers, fragmentation).
Engine, per GPU: weights P x bytes / TP, a fixed runtime overhead, and the KV cache in what is
  left of gpu_memory_utilization x GPU; 2 x layers x kv_heads x head_dim x bytes per token / TP.
  Refused when the weights do not fit or the cache cannot hold one max_model_len sequence (vLLM
  refuses to start then); fewer concurrent sequences than a round asks for is only a warning.

The ZeRO-3 model-state figure is printed next to DeepSpeed's own estimator
(`estimate_zero3_model_states_mem_needs*`, which budgets 18 bytes/param and a 1.5x CPU factor).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_tba.config import RunConfig

GiB = 2**30
USABLE_FRACTION = 0.9
ENGINE_OVERHEAD_GIB = 3.0
REFERENCE_ALGOS = ("tb", "alol", "dpo", "grpo")
DEFAULT_MICRO_BATCH = 4


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers the planner needs (a Llama-style decoder)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        heads = 1 if self.tie_embeddings else 2
        return heads * self.embedding_params + self.num_layers * self.layer_params + self.hidden_size

    @property
    def largest_layer_params(self) -> int:
        return max(self.embedding_params, self.layer_params)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


# Planner-only specs, keyed by a name the model path's directory name contains.
KNOWN_MODELS: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec("llama-3.1-70b", 128256, 8192, 28672, 80, 64, 8),
    ModelSpec("llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8),
    ModelSpec("llama-3.2-3b", 128256, 3072, 8192, 28, 24, 8, tie_embeddings=True),
    ModelSpec("llama-3.2-1b", 128256, 2048, 8192, 16, 32, 8, tie_embeddings=True),
    ModelSpec("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4),
    ModelSpec("qwen2.5-72b", 152064, 8192, 29568, 80, 64, 8),
)}


def model_spec(cfg: RunConfig, arch: str | None = None) -> ModelSpec:
    """The architecture: --arch, else the path's config.json, else a known name in the path."""
    m = cfg.model
    if arch:
        if arch not in KNOWN_MODELS:
            raise ValueError(f"unknown --arch {arch!r}; known: {', '.join(KNOWN_MODELS)}")
        return KNOWN_MODELS[arch]
    if m.path == "embedded":
        # The tiny char-level Llama: vocabulary of a few dozen symbols; 4x MLP.
        return ModelSpec("embedded", 64, m.hidden_size, 4 * m.hidden_size, m.num_layers,
                         m.num_heads, m.num_heads, tie_embeddings=True)
    config_json = Path(m.path) / "config.json"
    if config_json.is_file():
        hf = json.loads(config_json.read_text())
        # GPT-2's config.json spells the sizes n_embd / n_layer / n_head / n_inner (None = 4 x width)
        width, heads = hf.get("hidden_size", hf.get("n_embd")), hf.get("num_attention_heads", hf.get("n_head"))
        return ModelSpec(Path(m.path).name, hf["vocab_size"], width,
                         hf.get("intermediate_size") or hf.get("n_inner") or 4 * width,
                         hf.get("num_hidden_layers", hf.get("n_layer")), heads,
                         hf.get("num_key_value_heads") or heads,
                         tie_embeddings=hf.get("tie_word_embeddings", hf.get("model_type") == "gpt2"))
    key = Path(m.path).name.lower().replace("meta-", "")
    for name, spec in KNOWN_MODELS.items():
        if name in key:
            return spec
    raise ValueError(f"cannot tell the architecture of model.path={m.path!r}: no config.json "
                     f"there and no known name in it; pass --arch ({', '.join(KNOWN_MODELS)})")


@dataclasses.dataclass
class Plan:
    """What `hpc-tba plan` prints; `problems` non-empty means refused."""

    lines: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    learner_gib: float = 0.0
    engine_gib: float = 0.0
    model_states_gib: float = 0.0
    deepspeed_gib: float | None = None

    @property
    def fits(self) -> bool:
        return not self.problems

    def row(self, label: str, nbytes: float, note: str = "") -> float:
        self.lines.append(f"    {label:<44} {nbytes / GiB:9.2f} GiB  {note}".rstrip())
        return nbytes


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """Learner settings the config does not carry yet (flags of `hpc-tba plan`)."""

    arch: str | None = None
    micro_batch: int | None = None
    offload: str = "none"  # none | optimizer | all
    checkpointing: bool = True
    deepspeed: bool = True


def _learner(plan: Plan, cfg: RunConfig, spec: ModelSpec, opt: PlanOptions, gpus: int,
             capacity: float) -> None:
    c, lr = cfg.cluster, cfg.learner
    n = max(cfg.cluster.num_learners, 1)
    pb = 2 if lr.dtype == "bf16" else 4
    ob = 12 if lr.dtype == "bf16" else 8
    p = spec.params
    b = opt.micro_batch or getattr(lr, "micro_batch_size", 0) or DEFAULT_MICRO_BATCH
    t = cfg.searcher.max_model_len
    src = "" if opt.micro_batch or getattr(lr, "micro_batch_size", 0) else ", planner default"
    where = "GPUs" if gpus else "CPU ranks"
    plan.lines.append(f"  learner, per rank (ZeRO-{lr.zero_stage} over {n} {where}, "
                      f"{lr.dtype}, offload={opt.offload}):")
    on_gpu = {"params": opt.offload != "all", "optim": opt.offload == "none"}
    total = plan.row("parameters (sharded)", pb * p / n * on_gpu["params"])
    total += plan.row("gradients (sharded)", pb * p / n)
    total += plan.row("optimizer states (sharded)", ob * p / n * on_gpu["optim"],
                      "" if on_gpu["optim"] else "(on CPU)")
    plan.model_states_gib = total / GiB
    if cfg.algo.name in REFERENCE_ALGOS:
        total += plan.row(f"frozen reference for {cfg.algo.name} (sharded)", pb * p / n)
    total += plan.row("gathered layers (live + prefetch + grad)", 3 * spec.largest_layer_params * pb)
    tokens = b * t
    h, layers = spec.hidden_size, spec.num_layers
    if opt.checkpointing:
        act = layers * tokens * h * 2 + 34 * tokens * h
    else:
        act = layers * 34 * tokens * h
    ck = "ckpt" if opt.checkpointing else "no ckpt"
    total += plan.row(f"activations ({ck})", act, f"micro-batch {b} x {t} tokens{src}")
    total += plan.row("logits and log-probs of the micro-batch", tokens * spec.vocab_size * 10)
    plan.learner_gib = total / GiB
    if gpus:
        plan.lines.append(f"    {'total':<44} {total / GiB:9.2f} GiB  of {capacity / GiB:.2f} "
                          f"usable ({USABLE_FRACTION:.0%} of {c.gpu_memory_gb:g} GB)")
        if total > capacity:
            plan.problems.append(
                f"learner needs {total / GiB:.1f} GiB per GPU but {capacity / GiB:.1f} GiB are "
                f"usable: add learner nodes, offload (--offload optimizer|all), or shrink the "
                f"micro-batch")
    if opt.offload != "none" and c.cpu_memory_gb:
        host = (ob + (pb if opt.offload == "all" else 0)) * p / n * max(gpus, 1)
        plan.lines.append(f"    host memory per node for offload: {host / GiB:.1f} GiB of "
                          f"{c.cpu_memory_gb * 1e9 / GiB:.1f}")
        if host > c.cpu_memory_gb * 1e9 * USABLE_FRACTION:
            plan.problems.append("offloaded optimizer states do not fit in host memory per node")
    _compare_deepspeed(plan, spec, opt, gpus, cfg)


def _compare_deepspeed(plan: Plan, spec: ModelSpec, opt: PlanOptions, gpus: int,
                       cfg: RunConfig) -> None:
    """Print DeepSpeed's own ZeRO-3 model-state estimate next to ours."""
    if not opt.deepspeed:
        return
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
        num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=opt.offload != "none",
        cpu_offload_params=opt.offload == "all", zero_init=True)
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


def make_plan(cfg: RunConfig, opt: PlanOptions = PlanOptions()) -> Plan:
    """Build the plan for a composed config; layout errors become problems."""
    from hpc_tba.launcher.slurm import topology_of
    from hpc_tba.topology import LayoutError

    plan, c = Plan(), cfg.cluster
    spec = model_spec(cfg, opt.arch)
    plan.lines.append(f"plan: {cfg.name}  model {spec.name}: {spec.params / 1e9:.2f} B params, "
                      f"largest layer {spec.largest_layer_params / 1e9:.3f} B")
    try:
        topo = topology_of(cfg)
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
    _learner(plan, cfg, spec, opt, gpus, capacity)
    if c.num_searchers:
        _engine(plan, cfg, spec, gpus)
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
        elif key == "--micro-batch":
            kw["micro_batch"] = int(val or next(it))
        elif key == "--offload":
            kw["offload"] = val or next(it)
            if kw["offload"] not in ("none", "optimizer", "all"):
                raise ValueError("--offload takes none, optimizer or all")
        elif a == "--no-activation-checkpointing":
            kw["checkpointing"] = False
        elif a == "--no-deepspeed":
            kw["deepspeed"] = False
        elif a.startswith("--"):
            raise ValueError(f"unknown option {a}")
        else:
            overrides.append(a)
    return overrides, PlanOptions(**kw)


def plan_main(argv: list[str]) -> int:
    """`hpc-tba plan <overrides> [--arch A --micro-batch B --offload X ...]`: 0 fits, 1 refused,
    2 the config or an option is wrong."""
    from hpc_tba.config import ConfigError, compose

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
