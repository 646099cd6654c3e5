"""Checkpoint saves that do not stall training: staged to node-local storage, copied behind it.

Why: at 70B one save is 847 GB (hpc-tba plan), 14 minutes at 1 GB/s of shared filesystem; a
synchronous save stops 128 GPUs for all of it. Here each learner rank writes its part
(`checkpoint._write_part`: DeepSpeed's shards, buffer-shard state, RNG) into its own directory on
node-local storage (`cluster.checkpoint_staging_dir`, NVMe: seconds), then a background thread
(`_BackgroundCopy`) copies it into the shared `.tmp-step_*` directory file by file, an fsync
each, while training goes on. Once every rank's copy is done (the learner agrees it in the
all-reduce it makes every step anyway, or waits for it), learner rank 0 completes it exactly as a
direct save does (`checkpoint._publish`: COMPLETE, rename, `latest`, prune).

Never half a checkpoint: until that commit the shared copy is a `.tmp-*` directory without
COMPLETE, which `runfiles.latest_checkpoint` (resume=auto) never picks and the next save's prune
removes, whenever the job dies. `Checkpointer.save` waits for (and commits) a copy still running
before staging the next one, and the run's final save (USR1, the last step) drops an unfinished
copy whole and writes the newest state directly (the grace the planner checks holds one save).
DeepSpeed's format is unchanged, so loading and its trust guard are the same for both paths.
DeepSpeed's own asynchronous engines were not used: FastCheckpointEngine and the decoupled
engine need its compiled async_io op (libaio) and Nebula an Azure service; this path runs the same
code on CPU and GPU.

Test hook: HPC_TBA_FAULT_SLOW_CKPT_COPY_S=<s> sleeps s seconds after each file copied.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import threading
import time

from hpc_tba.checkpoint import store as checkpoint
from hpc_tba.checkpoint.runfiles import checkpoint_root
from hpc_tba.checkpoint.store import CheckpointError, _barrier, _fsync_dir, _publish, _write_json, _write_part

COPY_CHUNK_BYTES = 64 * 2**20
"""Read/write unit of the background copy; a discard takes effect within one chunk."""


class _BackgroundCopy:
    """This rank's staged files copied (thread) into the shared temporary directory; the staged
    directory is removed once copied. `error` holds what stopped a copy that failed."""

    def __init__(self, src: str, dst: str, *, delay_s: float = 0.0):
        self.src, self.dst, self.delay_s = src, dst, delay_s
        self.cancelled, self.error = threading.Event(), None
        self.copied_bytes = 0
        self._thread = threading.Thread(target=self._run, name="hpc-tba-ckpt-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for dirpath, _, files in os.walk(self.src):
                out = os.path.join(self.dst, os.path.relpath(dirpath, self.src))
                os.makedirs(out, exist_ok=True)
                for name in sorted(files):
                    self._copy_file(os.path.join(dirpath, name), os.path.join(out, name))
                    if self.delay_s:
                        self.cancelled.wait(self.delay_s)
                    if self.cancelled.is_set():
                        return
                _fsync_dir(out)
            shutil.rmtree(self.src, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - raised by wait(), on the training thread
            self.error = e

    def _copy_file(self, src: str, dst: str) -> None:
        with open(src, "rb") as fi, open(dst, "wb") as fo:
            while chunk := fi.read(COPY_CHUNK_BYTES):
                if self.cancelled.is_set():
                    return
                fo.write(chunk)
                self.copied_bytes += len(chunk)
            fo.flush()
            os.fsync(fo.fileno())

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise CheckpointError(f"copying the staged checkpoint {self.src} to {self.dst} "
                                  f"failed: {self.error}") from self.error

    def cancel(self) -> None:
        self.cancelled.set()
        self._thread.join()


@dataclasses.dataclass
class PendingSave:
    """A staged checkpoint whose copy to the run directory may still be running."""

    root: str
    name: str
    learner_rank: int
    keep_last: int
    copy: _BackgroundCopy

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.name)

    @property
    def step(self) -> int:
        return int(self.name.split("_")[1])


def staging_dir(staging_root: str, run_dir: str) -> str:
    """This run's directory under the node-local `staging_root` ($VARS expanded on the node)."""
    root = os.path.expandvars(os.path.expanduser(staging_root))
    if "$" in root:
        raise ValueError(f"cluster.checkpoint_staging_dir={staging_root!r}: an environment "
                         f"variable in it is not set on {os.uname().nodename}")
    digest = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    return os.path.join(root, f"hpc_tba-ckpt-{digest}")


def save_staged(engine, *, run_dir: str, staging: str, step: int, learner_rank: int,
                shard_state: dict, learner_state: dict, keep_last: int) -> PendingSave:
    """Collective: write this rank's part to node-local `staging` (training waits for this only)
    and start copying it to the run directory; `commit` it once every rank's copy is done."""
    import torch.distributed as dist

    root = checkpoint_root(run_dir)
    name = f"step_{step:06d}"
    tmp = os.path.join(root, f".tmp-{name}")
    rank_dir = os.path.join(staging, f"rank{learner_rank}")
    shutil.rmtree(rank_dir, ignore_errors=True)  # a staged copy a crash left behind
    local = os.path.join(rank_dir, name)
    os.makedirs(local)
    if learner_rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _write_part(engine, local, learner_rank, shard_state)
    if learner_rank == 0:
        _write_json(os.path.join(local, "learner.json"), learner_state)
    _barrier(dist)  # the shared temporary directory exists before any copy writes into it
    delay = float(os.environ.get("HPC_TBA_FAULT_SLOW_CKPT_COPY_S", "0") or 0)
    return PendingSave(root, name, learner_rank, keep_last, _BackgroundCopy(local, tmp, delay_s=delay))


def commit(pending: PendingSave, *, agreed: bool = False) -> str:
    """Collective: wait for this rank's copy, then (learner rank 0) make the checkpoint complete
    and current. `agreed`: every rank's copy is known to be done (the caller's all-reduce)."""
    import torch.distributed as dist

    pending.copy.wait()
    if not agreed:
        _barrier(dist)
    if pending.learner_rank == 0:
        _publish(pending.root, pending.name, pending.keep_last)
    return pending.path


def discard(pending: PendingSave) -> None:
    """Stop this rank's unfinished copy and drop it whole: what was copied stays in a `.tmp-*`
    directory without COMPLETE, which the next save's prune removes."""
    pending.copy.cancel()
    shutil.rmtree(pending.copy.src, ignore_errors=True)


class Checkpointer:
    """The learner's saves: direct, or staged with at most one copy in flight (module docstring)."""

    def __init__(self, engine, *, run_dir: str, learner_rank: int, keep_last: int,
                 staging: str | None, on_commit=None):
        self.engine, self.run_dir, self.lrank = engine, run_dir, learner_rank
        self.keep_last, self.staging = keep_last, staging
        self.on_commit = on_commit  # called with (step, seconds waited) when a staged save commits
        self.pending: PendingSave | None = None

    def copying(self) -> bool:
        """This rank's staged copy is still running (the learner all-reduces it every step)."""
        return self.pending is not None and not self.pending.copy.done()

    def agreed(self, *, copying_anywhere: bool) -> int | None:
        """After the all-reduce: commit a staged save no rank is still copying; its step."""
        if self.pending is None or copying_anywhere:
            return None
        return self._commit(agreed=True)

    def save(self, *, step: int, shard_state: dict, learner_state: dict, final: bool) -> str:
        """Collective. `final` (USR1, the run's end): drop a copy in flight, write directly."""
        if self.pending is not None:
            if final:
                discard(self.pending)
                self.pending = None
            else:  # at most one copy in flight: the next save waits for the previous one
                self._commit(agreed=False)
        kw = dict(run_dir=self.run_dir, step=step, learner_rank=self.lrank,
                  shard_state=shard_state, learner_state=learner_state, keep_last=self.keep_last)
        if final or not self.staging:
            return checkpoint.save(self.engine, **kw)
        self.pending = save_staged(self.engine, staging=self.staging, **kw)
        return self.pending.path

    def _commit(self, *, agreed: bool) -> int:
        t0, (pending, self.pending) = time.perf_counter(), (self.pending, None)
        commit(pending, agreed=agreed)
        if self.on_commit is not None:
            self.on_commit(pending.step, time.perf_counter() - t0)
        return pending.step
