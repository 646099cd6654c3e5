"""What a rank shows on the terminal, and where everything else it writes goes.

A quiet terminal: each rank keeps a handle on the real terminal (a dup of fd 1 and 2 taken at
rank start) for our own lines — the progress bar, lines starting with ``hpc-tba:``, the summary —
and sends everything else to ``<run_dir>/logs/rank<N>.log``: third-party Python output (vLLM,
DeepSpeed, torch warnings) *and* what C libraries write to fd 1/2 (NUMA, Triton, libiomp notices),
because fd 1/2 themselves are redirected with ``os.dup2``. Child processes the rank starts inherit
the redirected fds, so their output lands in the same log. Nothing is dropped.

Verbose (``hpc-tba train -v`` or ``HPC_TBA_VERBOSE=1``): fd 1/2 go through a pipe that a thread
copies to both the log and the terminal, so the same output is also shown live.

A failing rank records its error in ``<run_dir>/logs/failed_rank<N>.json`` and the first one to
fail claims ``logs/first_failure``; the launcher (`hpc-tba train`) prints that failure once, with
the path of its log, after the job ended. A rank started by something else (srun in an sbatch
script) prints the first failure itself.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import sys
import threading
import time

ECHO_PREFIX = "hpc-tba"
"""Lines starting with this (our own messages, whichever module prints them) reach the terminal."""
LAUNCHER_ENV = "HPC_TBA_LAUNCHER"
"""Set to `cli` by `hpc-tba train`: the launcher reports a failed rank, not the rank itself."""
VERBOSE_ENV = "HPC_TBA_VERBOSE"
"""`1`: show every rank's third-party output live as well as logging it."""

_terminal: dict[str, io.TextIOBase] = {}


def terminal(stream: str = "err") -> io.TextIOBase:
    """The real terminal (`out` or `err`) of this process, whatever fd 1/2 point to now."""
    return _terminal.get(stream) or (sys.stdout if stream == "out" else sys.stderr)


def say(message: str, *, stream: str = "err") -> None:
    """One of our own lines, on the terminal."""
    out = terminal(stream)
    out.write(message.rstrip("\n") + "\n")
    out.flush()


def rank_from_environ(environ=None) -> int:
    """This process's rank before MPI is initialised (mpiexec/srun/Open MPI set these)."""
    env = os.environ if environ is None else environ
    for key in ("PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


def log_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "logs")


def rank_log_path(run_dir: str, rank: int) -> str:
    return os.path.join(log_dir(run_dir), f"rank{rank}.log")


class _LineRouter(io.TextIOBase):
    """sys.stdout/sys.stderr of a quiet rank: every write goes to the log; whole lines that start
    with ECHO_PREFIX are also written to the terminal."""

    def __init__(self, log: io.TextIOBase, term: io.TextIOBase, fd: int, lock: threading.Lock):
        self._log, self._term, self._fd, self._lock = log, term, fd, lock
        self._pending = ""

    def write(self, s: str) -> int:
        with self._lock:
            self._log.write(s)
            self._log.flush()  # keep order with what C code writes straight to the fd
            self._pending += s
            *lines, self._pending = self._pending.split("\n")
            shown = [line for line in lines if line.startswith(ECHO_PREFIX)]
            if shown:
                self._term.write("\n".join(shown) + "\n")
                self._term.flush()
        return len(s)

    def flush(self) -> None:
        with self._lock:
            self._log.flush()
            self._term.flush()

    def fileno(self) -> int:  # faulthandler, subprocess: the redirected fd itself
        return self._fd

    def isatty(self) -> bool:
        return False

    @property
    def buffer(self):  # code writing bytes to sys.stdout.buffer: into the log
        self.flush()
        return self._log.buffer

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return "utf-8"


def _tee(read_fd: int, log_fd: int, term: io.TextIOBase) -> None:
    """Verbose mode: copy the rank's fd 1/2 output to the log and the terminal until EOF."""
    while True:
        try:
            data = os.read(read_fd, 65536)
        except OSError:
            return
        if not data:
            return
        os.write(log_fd, data)
        term.buffer.write(data)
        term.flush()


def _drain(tee: threading.Thread) -> None:
    """At exit: close our ends of the pipe so the tee sees EOF, and let it copy what is left."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    tee.join(timeout=5.0)


def setup_rank_output(run_dir: str, rank: int, *, verbose: bool | None = None) -> str:
    """Send this rank's fd 1/2 (and sys.stdout/stderr) to its log; keep the terminal for our lines.

    Returns the log path. Called once at rank start, before vLLM, DeepSpeed or torch are imported
    (their loggers bind to sys.stderr when they are created).
    """
    if verbose is None:
        verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0", "false")
    os.makedirs(log_dir(run_dir), exist_ok=True)
    path = rank_log_path(run_dir, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    _terminal["out"] = open(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    _terminal["err"] = open(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    header = (f"=== rank {rank} pid {os.getpid()} on {os.uname().nodename} started "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')} (Slurm job {os.environ.get('SLURM_JOB_ID', '-')}, "
              f"restart {os.environ.get('SLURM_RESTART_COUNT', '0')}) ===\n")
    os.write(log_fd, header.encode())
    if verbose:
        read_fd, write_fd = os.pipe()
        tee = threading.Thread(target=_tee, args=(read_fd, log_fd, _terminal["err"]), daemon=True,
                               name="hpc-tba-tee")
        tee.start()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        atexit.register(_drain, tee)
        return path  # sys.stdout/stderr keep writing to fd 1/2, now the pipe
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    log = open(log_fd, "w", buffering=1, encoding="utf-8", errors="replace")
    lock = threading.Lock()
    sys.stdout = _LineRouter(log, _terminal["out"], 1, lock)
    sys.stderr = _LineRouter(log, _terminal["err"], 2, lock)
    return path


@contextlib.contextmanager
def captured(path: str, *, verbose: bool = False):
    """Within the block, fd 1/2 and sys.stdout/stderr of this process go to `path` (appended),
    except lines starting with ECHO_PREFIX; for the launcher's own noisy steps (the build)."""
    if verbose:
        yield
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    saved_py = sys.stdout, sys.stderr
    term = {"out": open(os.dup(1), "w", buffering=1), "err": open(os.dup(2), "w", buffering=1)}
    log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    lock = threading.Lock()
    sys.stdout = _LineRouter(log, term["out"], 1, lock)
    sys.stderr = _LineRouter(log, term["err"], 2, lock)
    previous = dict(_terminal)
    _terminal.update(term)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved_py
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        _terminal.clear()
        _terminal.update(previous)
        for f in (*term.values(), log):
            f.close()


# ---------------------------------------------------------------------------- failures
def record_failure(run_dir: str, rank: int, message: str) -> bool:
    """Write this rank's failure next to its log; True when it is the job's first failure."""
    d = log_dir(run_dir)
    os.makedirs(d, exist_ok=True)
    record = {"rank": rank, "message": message, "log": rank_log_path(run_dir, rank), "time": time.time()}
    from hpc_tba.checkpoint.runfiles import write_json_atomic

    write_json_atomic(os.path.join(d, f"failed_rank{rank}.json"), record)
    try:
        fd = os.open(os.path.join(d, "first_failure"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{rank}\n")
    return True


def failures(run_dir: str) -> list[dict]:
    """Failure records of the run's ranks, the first failure first."""
    d = log_dir(run_dir)
    if not os.path.isdir(d):
        return []
    out = []
    for name in sorted(os.listdir(d)):
        if name.startswith("failed_rank") and name.endswith(".json"):
            try:
                with open(os.path.join(d, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue
    first = None
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(d, "first_failure")) as f:
            first = int(f.read().strip())
    out.sort(key=lambda r: (r.get("rank") != first, r.get("time", 0.0)))
    return out


def failure_line(records: list[dict]) -> str:
    """The one line a user reads about a failed job: the first error, whole, and its log."""
    first = records[0]
    message = " ".join(str(first["message"]).split())  # whole, on one line
    line = f"hpc-tba: rank {first['rank']} failed: {message}"
    others = sorted(r["rank"] for r in records[1:])
    line += f" (log: {first['log']}"
    if others:
        line += f"; ranks {', '.join(map(str, others))} failed too, logs next to it"
    return line + ")"
