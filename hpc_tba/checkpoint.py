"""Atomic learner checkpoints, resume, and export of the policy to a Hugging Face directory.

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
import os
import pickle  # only for its exception type: nothing here unpickles without weights_only
import re
import shutil
from collections.abc import Sequence

import torch

COMPLETE = "COMPLETE"


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
            "other objects (see hpc_tba.checkpoint.deepspeed_safe_globals)") from None
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


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest complete checkpoint directory, or None (half-written ones are ignored)."""
    root = checkpoint_root(run_dir)
    pointer = os.path.join(root, "latest")
    candidates = []
    if os.path.isfile(pointer):
        with open(pointer) as f:
            candidates.append(os.path.join(root, f.read().strip()))
    if os.path.isdir(root):  # `latest` lost or pointing at a removed dir: fall back to a scan
        candidates += sorted((os.path.join(root, d) for d in os.listdir(root)
                              if d.startswith("step_")), reverse=True)
    for path in candidates:
        if os.path.isfile(os.path.join(path, COMPLETE)):
            return path
    return None


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
    engine.save_checkpoint(tmp, tag="ds", save_latest=False)
    _write_json(os.path.join(tmp, f"rank{learner_rank}.json"), shard_state)
    torch.save({"cpu": torch.get_rng_state()}, os.path.join(tmp, f"rng_rank{learner_rank}.pt"))
    _barrier(dist)
    if learner_rank == 0:
        _write_json(os.path.join(tmp, "learner.json"), learner_state)
        _fsync_dir(tmp)
        open(os.path.join(tmp, COMPLETE), "w").close()
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_json_atomic_text(os.path.join(root, "latest"), name)
        _prune(root, keep_last)
    _barrier(dist)
    return final


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


def export_hf(engine, out_dir: str, *, tokenizer_src: str, learner_rank: int) -> None:
    """Gather the full policy (collective) and write it as a Hugging Face directory (safetensors)."""
    import deepspeed

    module = engine.module
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if learner_rank == 0:
            state = {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}
    if learner_rank != 0:
        return
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    for name in os.listdir(tokenizer_src):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(tokenizer_src, name), tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


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
