"""Atomic learner checkpoints, resume, and export of the policy to a Hugging Face directory.

Export (`export_hf`): layer by layer into sharded safetensors, never more than one layer
gathered on any rank (at 70B the whole-model gather the export used to do is 140 GB per rank);
ZeRO-3 partitions and learner TP slices alike (`gathered`).

Layout under `<run_dir>/checkpoints/`:

    step_000120/            one complete checkpoint (a `.tmp-step_000120` while being written)
      ds/                   DeepSpeed ZeRO-3 state: model + optimizer shards of every rank,
                            scheduler (DeepSpeed's own format)
      learner.json          step, policy version, evaluation history, the resolved config
      rank{r}.json          per learner rank: buffer-shard state (RNG, segment-log offsets)
      rng_rank{r}.pt        per learner rank: torch RNG state (tensors only: weights_only loads)
      COMPLETE              written last; a directory without it is ignored
    latest                  name of the newest complete checkpoint (replaced atomically)

Writing: every learner rank writes into the temporary directory, a barrier, then learner rank 0
writes learner.json and COMPLETE, renames the directory into place, replaces `latest` and deletes
all but the newest `keep_last`. A crash at any point leaves either the previous checkpoint as
`latest` or a `.tmp-*` directory that resume ignores and the next save removes.

Staged saves (hpc_tba.checkpoint.staging, `cluster.checkpoint_staging_dir`): each rank writes its
part to node-local storage and a background thread copies it into the shared `.tmp-*` directory;
`_publish` then completes it exactly as above, so a copy that never finished is never `latest`.

The buffer's contents are not copied: the append-only segment log already holds every accepted
trajectory, and the shard state records the log offsets at the checkpoint; resume replays the
log, so it restores the buffer as of the checkpoint plus every record accepted after it.

Trust: nothing read back executes code. Every `.pt` file, ours and DeepSpeed's, is loaded with
`torch.load(weights_only=True)`, whose unpickler builds only tensors, plain containers and
explicitly allowed classes; anything else (a file replaced by a pickle that would run code when
loaded) is refused with one `CheckpointError` naming the file, before any of it runs. DeepSpeed
itself reads its model and optimizer states with `weights_only=False` through its checkpoint
engine's `load`, so `load` wraps the engine's checkpoint engine for the duration of the call
(`_WeightsOnlyLoads`: that one method replaced, everything else delegated). Besides tensors,
dicts, lists, `torch.Size` and `OrderedDict`, DeepSpeed's ZeRO-3 files (fp32 or bf16, inspected
on DeepSpeed 0.19) hold two small objects of its own, the ZeRO stage (`ZeroStageEnum`, an
`int` enum) and the static `LossScaler` (its scale); `deepspeed_safe_globals()` allows exactly
those, and a test checks that each is needed. Writing our own pickle-free format instead would
mean re-implementing ZeRO-3's partitioned optimizer state (and its loader) for every DeepSpeed
release; the allow-list keeps DeepSpeed's format and its resume logic and adds only the guard.
DeepSpeed paths that call `torch.load` without going through the checkpoint engine (universal
checkpoints, `load_optimizer_states=False` under ZeRO-3) are refused or not used. With several
learner ranks the rank holding a refused file raises; the launcher (mpiexec, srun) then ends the
others, which would otherwise wait in DeepSpeed's collectives.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import pickle  # only for its exception type: nothing here unpickles without weights_only
import re
import shutil
from collections.abc import Sequence

import torch

from hpc_tba.checkpoint.runfiles import COMPLETE, checkpoint_root, latest_checkpoint  # torch-free: status uses them too


class CheckpointError(RuntimeError):
    """A checkpoint file that is missing, unreadable, or holds more than tensors and plain data."""


def deepspeed_safe_globals() -> list[type]:
    """The non-tensor classes in DeepSpeed's ZeRO-3 checkpoint files (see the module docstring)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler]


def load_tensors(path: str, *, map_location=None, allowed: Sequence[type] = ()):
    """`torch.load(path, weights_only=True)`, with `allowed` classes beyond tensors and plain data.

    Raises CheckpointError naming `path` if the file is missing, corrupt, or would need any other
    global (the unpickler refuses it before calling anything).
    """
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"checkpoint file {path} refused: it holds objects other than tensors and plain data "
            f"({_unpickler_reason(e)}). It was loaded with torch.load(weights_only=True) and "
            "nothing in it was run: the file was altered, or written by a DeepSpeed that stores "
            "other objects (see hpc_tba.checkpoint.store.deepspeed_safe_globals)") from None
    except (OSError, EOFError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is unreadable: {e}") from None


def _unpickler_reason(e: Exception) -> str:
    """The one line of torch's weights_only error that says what was refused."""
    text = str(e)
    found = re.search(r"Unsupported (?:global|operand)[^\n]*?(?=\. |\n|$)", text)
    if found:
        return found.group(0)
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    return found.group(1) if found else text.strip().splitlines()[-1]


class _WeightsOnlyLoads:
    """DeepSpeed's checkpoint engine with `load` going through `load_tensors`; all else delegated."""

    def __init__(self, inner, allowed: Sequence[type]):
        self._inner, self._allowed = inner, allowed

    def load(self, path: str, map_location=None):
        return load_tensors(path, map_location=map_location, allowed=self._allowed)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


@contextlib.contextmanager
def _weights_only_deepspeed_loads(engine):
    original = engine.checkpoint_engine
    engine.checkpoint_engine = _WeightsOnlyLoads(original, deepspeed_safe_globals())
    try:
        yield
    finally:
        engine.checkpoint_engine = original


def resolve_resume(run_dir: str, resume: str) -> str | None:
    """`never` -> None; `auto` -> latest complete checkpoint or None; a path -> that checkpoint."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    if not os.path.isfile(os.path.join(resume, COMPLETE)):
        raise FileNotFoundError(f"resume={resume!r} is not a complete checkpoint (no {COMPLETE} file)")
    return resume


def save(engine, *, run_dir: str, step: int, learner_rank: int, shard_state: dict,
         learner_state: dict, keep_last: int) -> str:
    """Collective over the learner ranks. Returns the checkpoint directory."""
    import torch.distributed as dist

    root = checkpoint_root(run_dir)
    name = f"step_{step:06d}"
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    if learner_rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(dist)
    _write_part(engine, tmp, learner_rank, shard_state)
    _barrier(dist)
    if learner_rank == 0:
        _write_json(os.path.join(tmp, "learner.json"), learner_state)
        _publish(root, name, keep_last)
    _barrier(dist)
    return final


def _write_part(engine, directory: str, learner_rank: int, shard_state: dict) -> None:
    """This rank's files of a checkpoint: DeepSpeed's shards, buffer-shard state, RNG."""
    engine.save_checkpoint(directory, tag="ds", save_latest=False)
    _write_json(os.path.join(directory, f"rank{learner_rank}.json"), shard_state)
    torch.save({"cpu": torch.get_rng_state()}, os.path.join(directory, f"rng_rank{learner_rank}.pt"))


def _publish(root: str, name: str, keep_last: int) -> None:
    """Learner rank 0: the complete `.tmp-<name>` becomes `<name>`, then `latest`, then prune."""
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    for dirpath, _, _ in os.walk(tmp):
        _fsync_dir(dirpath)
    open(os.path.join(tmp, COMPLETE), "w").close()
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_json_atomic_text(os.path.join(root, "latest"), name)
    _prune(root, keep_last)


def load(engine, path: str, *, learner_rank: int) -> tuple[dict, dict]:
    """Restore DeepSpeed state and this rank's RNG; returns (learner_state, shard_state).

    Every file is read without executing anything in it (module docstring); a refused or
    unreadable file raises CheckpointError naming it.
    """
    try:
        with open(os.path.join(path, "learner.json")) as f:
            learner_state = json.load(f)
        with open(os.path.join(path, f"rank{learner_rank}.json")) as f:
            shard_state = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable: {e}") from None
    rng = load_tensors(os.path.join(path, f"rng_rank{learner_rank}.pt"))
    if getattr(engine, "load_universal_checkpoint", lambda: False)():
        raise CheckpointError("DeepSpeed reads universal checkpoints with pickle, outside its "
                              "checkpoint engine: turn `load_universal_checkpoint` off")
    with _weights_only_deepspeed_loads(engine):
        load_path, _ = engine.load_checkpoint(path, tag="ds", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    if load_path is None:
        raise CheckpointError(f"checkpoint {path}: DeepSpeed found no state under {path}/ds")
    torch.set_rng_state(rng["cpu"])
    return learner_state, shard_state


DEFAULT_SHARD_BYTES = 5 * 2**30
"""Largest safetensors file of an export (transformers' default `max_shard_size` is 5 GB)."""


def layer_groups(module: torch.nn.Module) -> list[tuple[str, list[tuple[str, torch.nn.Parameter]]]]:
    """The model's parameters in `named_parameters` order (tied ones once), grouped by layer: one
    decoder block (the prefix up to the first list index, `model.layers.3`) or one other module
    (`model.embed_tokens`, `model.norm`, `lm_head`). Every rank gets the same groups."""
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in module.named_parameters():
        parts = name.split(".")
        cut = next((i + 1 for i, part in enumerate(parts[:-1]) if part.isdigit()), len(parts) - 1)
        groups.setdefault(".".join(parts[:cut]) or name, []).append((name, p))
    return list(groups.items())


def split_layer(p: torch.nn.Parameter):
    """The DeepSpeed AutoTP layer that split `p` into TP slices (learner tensor parallelism,
    hpc_tba.roles.tensor_parallel), or None for a parameter every TP rank holds whole."""
    from deepspeed.module_inject.layers import DS_IS_REPLACED_MODULE

    return p.gather_params.__self__ if getattr(p, DS_IS_REPLACED_MODULE, False) else None


def full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    """The whole parameter's shape: before AutoTP split it and ZeRO-3 partitioned it."""
    layer = split_layer(p)
    if layer is not None:
        return tuple(layer._orig_weight_shape if p is layer.weight else layer._orig_bias_shape)
    return tuple(getattr(p, "ds_shape", p.shape))


@contextlib.contextmanager
def gathered(params: list[torch.nn.Parameter]):
    """Every parameter of `params` whole on every rank for the block, read-only (collective over
    the learners): the ZeRO-3 gathers, then each TP-split parameter's slices
    (`GatherReplacedLayerParams`, all TP ranks together); a plain module's are no-ops."""
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None), contextlib.ExitStack() as tp:
        for p in params:
            layer = split_layer(p)
            if layer is not None:
                tp.enter_context(GatherReplacedLayerParams([p], layer))
        yield


def _nbytes(p: torch.nn.Parameter) -> int:
    return math.prod(full_shape(p)) * p.element_size()


def _shards(groups, shard_bytes: int) -> list[list[int]]:
    """Indices of `groups` per file: a file closes before the layer that would overflow it (a layer
    is never split; one larger than `shard_bytes` gets a file of its own)."""
    shards, size = [[]], 0
    for g, (_, params) in enumerate(groups):
        nbytes = sum(_nbytes(p) for _, p in params)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += nbytes
    return shards


def export_hf(engine, out_dir: str, *, tokenizer_src: str | None, learner_rank: int,
              shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write the policy as a Hugging Face directory of sharded safetensors (collective).

    One layer (`layer_groups`) is gathered at a time on every rank, so no rank ever holds more
    than the largest layer beyond its own shards; learner rank 0 copies each gathered layer to
    host memory and writes a file once it holds `shard_bytes` (host memory: one file plus one
    layer). Files `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`, as
    transformers' `save_pretrained` writes them, so `from_pretrained` and vLLM load the result.
    `engine` is a DeepSpeed engine or a plain module (then the gathers are no-ops). Under learner
    tensor parallelism each layer's TP slices are gathered too, by every TP rank together
    (`gathered`), so the files hold whole tensors.
    """
    from safetensors.torch import save_file

    module = getattr(engine, "module", engine)
    groups = layer_groups(module)
    shards = _shards(groups, shard_bytes)
    tmp, main = out_dir + ".tmp", learner_rank == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    weight_map, total = {}, 0
    for i, members in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for g in members:
            params = groups[g][1]
            with gathered([p for _, p in params]):
                if main:
                    tensors.update((n, p.detach().to("cpu", copy=True).contiguous()) for n, p in params)
        if main:
            tensors.update(_persistent_buffers(module, [groups[g][0] for g in members]))
            save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, fname))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            tensors.clear()
    if main:
        _write_json(os.path.join(tmp, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
        _save_config(module, tmp, tokenizer_src)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    _barrier(torch.distributed)


def _persistent_buffers(module: torch.nn.Module, prefixes: list[str]) -> dict[str, torch.Tensor]:
    """Buffers that belong in a state dict (not rotary caches) of the modules under `prefixes`."""
    out = {}
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            full = f"{mod_name}.{name}" if mod_name else name
            if buf is not None and name not in mod._non_persistent_buffers_set and any(
                    full.startswith(pre + ".") for pre in prefixes):
                out[full] = buf.detach().to("cpu", copy=True).contiguous()
    return out


def _save_config(module: torch.nn.Module, out: str, tokenizer_src: str | None) -> None:
    import copy

    config = copy.deepcopy(module.config)
    config.dtype = str(next(module.parameters()).dtype).split(".")[1]
    config.architectures = [type(module).__name__]
    config.save_pretrained(out)
    if getattr(module, "generation_config", None) is not None:
        module.generation_config.save_pretrained(out)
    for name in os.listdir(tokenizer_src) if tokenizer_src else ():
        if name.startswith(("tokenizer", "special_tokens", "generation_config", "vocab", "merges")):
            shutil.copy(os.path.join(tokenizer_src, name), out)


def _prune(root: str, keep_last: int) -> None:
    done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
    for d in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    for d in os.listdir(root):
        if d.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def _barrier(dist) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_json_atomic_text(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
