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
"""
from __future__ import annotations

import json
import os
import shutil

import torch

COMPLETE = "COMPLETE"


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
    """Restore DeepSpeed state and this rank's RNG; returns (learner_state, shard_state)."""
    try:
        with open(os.path.join(path, "learner.json")) as f:
            learner_state = json.load(f)
        with open(os.path.join(path, f"rank{learner_rank}.json")) as f:
            shard_state = json.load(f)
        rng = torch.load(os.path.join(path, f"rng_rank{learner_rank}.pt"), weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise RuntimeError(f"checkpoint {path} is unreadable: {e}") from None
    load_path, _ = engine.load_checkpoint(path, tag="ds", load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"checkpoint {path}: DeepSpeed found no state under {path}/ds")
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
