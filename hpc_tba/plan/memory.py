"""Memory arithmetic of the planner: model shapes, activations, logits and weight staging.

Pure functions of a `ModelSpec` and a few sizes, so the planner, the dry run and the learner
benchmark count memory the same way.

Activations, per token of a micro-batch and per decoder layer (a = bytes of the training dtype),
counted from what autograd keeps for the backward of a Llama block in transformers (eager
attention is not used: SDPA/flash keep q, k, v, the output and one fp32 log-sum-exp per head):

  attention   RMSNorm: its fp32 copy of the input 4h (none in fp32), normalised a h, output a h;
              q, k, v projections: a (h + 2 kv); rotary: q and k after rotation a (h + kv); attention output a h, its
              transposed-contiguous copy fed to o_proj a h; log-sum-exp 4 heads
  MLP         RMSNorm: (4h) + 2 a h; gate and up projections 2 a i; SiLU output a i; the product
              fed to down_proj a i

(h hidden size, kv = kv_heads x head_dim, i intermediate size). tests/test_planner.py checks this
count against the tensors autograd actually saves for a transformers Llama layer. Without gradient checkpointing
every layer keeps all of it. With checkpointing (transformers', non-reentrant) a layer keeps only
its input hidden state (a h per token), and the backward recomputes one layer at a time, so
one layer's full activations are live on top of the boundaries. The final norm and the input of
the language-model head are one more boundary.

Logits: the learner computes log-probs of the chosen tokens in chunks of
`learner.logprob_chunk_tokens` positions, so at most one chunk's logits exist: the head's output
in the training dtype (a V per position), its fp32 log-softmax (4 V) and that tensor's gradient
(4 V) in the backward.

Weight staging of a searcher (the receiver's memory, comm/weight_sync/staging.py): `device` keeps one
whole version in the wire dtype (the engine's) on the engine's GPU plus the bucket being
received; `host` keeps the version in pinned host memory and the bucket being received on the
GPU (NCCL does not receive into host memory); `stream`
loads each bucket into the engine as it arrives and holds two buckets on the GPU.
"""
from __future__ import annotations

import dataclasses

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "float16": 2, "fp16": 2, "half": 2}


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
    qkv_bias: bool = False
    """Biases on the q, k, v projections (Qwen2)."""
    model_type: str = "llama"
    """transformers' model_type, used by the dry run to build the config."""
    head_dim_override: int | None = None
    """head_dim when it is not hidden_size / num_heads (config.json's `head_dim`)."""

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return 2 * h * q + 2 * h * kv + bias + 3 * h * self.intermediate_size + 2 * h

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

    def layer_activation_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> dict[str, int]:
        """What one decoder layer keeps for its backward, per token (module docstring). `tp`
        (learner tensor parallelism): the heads' and the MLP's intermediate tensors are split
        over tp ranks; the norms' full-width tensors are not."""
        a, h, i = dtype_bytes, self.hidden_size, self.intermediate_size
        q, kv = self.q_dim, self.kv_dim
        norm = (4 * h if a < 4 else 0) + 2 * a * h  # the fp32 copy is the input itself in fp32
        attention = norm + -(-(a * (q + 2 * kv) + a * (q + kv) + 2 * a * q + 4 * self.num_heads) // tp)
        mlp = norm + -(-4 * a * i // tp)
        return {"attention": attention, "mlp": mlp}

    def split_layer_params(self, tp: int) -> int:
        """One decoder layer's parameters on one TP rank: the projections / tp, the norms whole."""
        return -(-(self.layer_params - 2 * self.hidden_size) // tp) + 2 * self.hidden_size


# Planner-only specs, keyed by a name the model path's directory name contains.
KNOWN_MODELS: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec("llama-3.1-70b", 128256, 8192, 28672, 80, 64, 8),
    ModelSpec("llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8),
    ModelSpec("llama-3.2-3b", 128256, 3072, 8192, 28, 24, 8, tie_embeddings=True),
    ModelSpec("llama-3.2-1b", 128256, 2048, 8192, 16, 32, 8, tie_embeddings=True),
    ModelSpec("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, qkv_bias=True, model_type="qwen2"),
    ModelSpec("qwen2.5-72b", 152064, 8192, 29568, 80, 64, 8, qkv_bias=True, model_type="qwen2"),
)}


def spec_from_hf_config(name: str, hf: dict) -> ModelSpec:
    """A ModelSpec from a transformers config.json dict."""
    model_type = hf.get("model_type", "llama")
    # GPT-2's config.json spells the sizes n_embd / n_layer / n_head / n_inner (None = 4 x width)
    width = hf.get("hidden_size", hf.get("n_embd"))
    heads = hf.get("num_attention_heads", hf.get("n_head"))
    return ModelSpec(name, hf["vocab_size"], width, hf.get("intermediate_size") or hf.get("n_inner") or 4 * width,
                     hf.get("num_hidden_layers", hf.get("n_layer")), heads, hf.get("num_key_value_heads") or heads,
                     tie_embeddings=bool(hf.get("tie_word_embeddings", model_type == "gpt2")),
                     qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
                     model_type=model_type, head_dim_override=hf.get("head_dim"))


@dataclasses.dataclass(frozen=True)
class ActivationMemory:
    """Bytes of activations of one micro-batch of `tokens` positions on one learner rank."""

    boundaries: int
    """Checkpointed layer inputs (with checkpointing; 0 without)."""
    live_layers: int
    """Full activations kept: one layer with checkpointing, every layer without."""
    per_layer: int
    """One layer's full activations for this micro-batch."""

    @property
    def total(self) -> int:
        return self.boundaries + self.live_layers


def activation_bytes(spec: ModelSpec, *, tokens: int, dtype_bytes: int,
                     checkpointing: bool, tp: int = 1) -> ActivationMemory:
    per_layer = tokens * sum(spec.layer_activation_bytes_per_token(dtype_bytes, tp).values())
    head_input = tokens * spec.hidden_size * (dtype_bytes + 4)  # final RMSNorm (fp32 input)
    if checkpointing:
        boundaries = spec.num_layers * tokens * spec.hidden_size * dtype_bytes + head_input
        return ActivationMemory(boundaries, per_layer, per_layer)
    return ActivationMemory(0, spec.num_layers * per_layer + head_input, per_layer)


def logit_bytes(spec: ModelSpec, *, chunk_tokens: int, dtype_bytes: int, grad: bool = True) -> int:
    """One chunk of logits: the head's output, its fp32 log-softmax and (training) its gradient."""
    per_position = spec.vocab_size * (dtype_bytes + 4 + (4 if grad else 0))
    return chunk_tokens * per_position


@dataclasses.dataclass(frozen=True)
class Staging:
    """A searcher's weight-staging memory for one mode (module docstring)."""

    mode: str
    device_bytes: int
    host_bytes: int


def staging_bytes(mode: str, *, version_bytes: int, bucket_bytes: int) -> Staging:
    """Receiver memory for `mode` (device|host|stream) given one version's and one bucket's bytes
    on the wire (the largest bucket of the manifest)."""
    if mode == "device":
        return Staging(mode, version_bytes + bucket_bytes, 0)
    if mode == "host":
        return Staging(mode, bucket_bytes, version_bytes)  # broadcasts land on the GPU (NCCL)
    if mode == "stream":  # comm.weight_sync.staging_bytes: 2 buckets, 3 while a loader holds both
        return Staging(mode, 3 * bucket_bytes, 0)
    raise ValueError(f"searcher.staging={mode!r} is not device, host or stream")


def bucket_sizes(spec: ModelSpec, *, bucket_bytes: int, wire_bytes: int) -> list[int]:
    """Bytes of each weight-sync bucket, greedy over the parameters in transformers' order (the
    same rule as Manifest.build: a bucket closes before the parameter that would overflow it)."""
    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    bias = spec.qkv_bias
    # transformers' order: q, k, v (each with its bias), o, gate, up, down, the two norms
    layer = [h * q] + [q] * bias + [h * kv] + [kv] * bias + [h * kv] + [kv] * bias
    layer += [q * h, h * i, h * i, i * h, h, h]
    numels = [spec.embedding_params] + layer * spec.num_layers + [h]
    if not spec.tie_embeddings:
        numels.append(spec.embedding_params)
    out, size = [], 0
    for n in numels:
        nbytes = n * wire_bytes
        if size and size + nbytes > bucket_bytes:
            out.append(size)
            size = 0
        size += nbytes
    return out + ([size] if size else [])


NODE_KINDS = ("learner0", "learner", "searcher")
"""Kinds of node the planner counts host memory for: learner rank 0's node (it also holds the
weight sync's held versions), any other learner node, a searcher node."""


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
    terms: dict[str, float] = dataclasses.field(default_factory=dict)
    """Bytes of each learner term per rank (keys: params, grads, optimizer, reference, gathered,
    activations, logits) and of the searcher staging (staging_device, staging_host)."""
    micro_batch: int = 0
    """Sequences per micro-batch the learner runs (learner.micro_batch_size, 0 = K; packed: the
    whole max_model_len sequences a learner.micro_batch_tokens bin holds)."""
    micro_batch_tokens: int = 0
    """Token positions of the largest micro-batch on one rank (micro_batch x max_model_len / SP,
    or learner.micro_batch_tokens)."""
    staging: str = ""
    """searcher.staging with auto resolved."""
    buckets: list[int] = dataclasses.field(default_factory=list)
    """Bytes of each weight-sync bucket on the wire, as the planner counts them."""
    sync_s: tuple[float, float] = (0.0, 0.0)
    """Seconds one version of the weight sync takes to leave the learners, (over every NIC of
    learner rank 0's node, through one of them): hpc_tba.plan.sync."""
    host_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    """Host memory each kind of node needs (keys: NODE_KINDS), what `hpc-tba doctor` checks a
    node's /proc/meminfo against."""

    @property
    def fits(self) -> bool:
        return not self.problems

    def row(self, label: str, nbytes: float, note: str = "", key: str = "") -> float:
        self.lines.append(f"    {label:<44} {nbytes / GiB:9.2f} GiB  {note}".rstrip())
        if key:
            self.terms[key] = nbytes
        return nbytes
