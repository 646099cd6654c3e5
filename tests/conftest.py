"""Shared test setup: CPU-only, one thread per process, DeepSpeed on its CPU accelerator; and the
helpers of the tests that spawn ranks (start them, set up their process group)."""
import contextlib
import os
import queue
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HPC_TBA_NO_PROGRESS", "1")
# tests/test_pins.py checks this venv against hpc_tba/pins.py once; the ranks and CLIs the tests
# start would each repeat the same line, and some tests read their stderr.
os.environ.setdefault("HPC_TBA_NO_PIN_CHECK", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What tests use but the installed package does not ship: the simulator, the local-Slurm harness and
# the experiment runner under tools/ (imported as `simulator`, `local_slurm`, `experiments`); test
# helpers such as buffer_helpers.py sit beside the tests (pytest puts tests/ on sys.path).
sys.path.insert(0, os.path.join(REPO, "tools"))
HPC_TBA = os.path.join(os.path.dirname(sys.executable), "hpc-tba")


def gloo_deepspeed(rank: int, world: int, port: int) -> None:
    """In a spawned test worker: DeepSpeed's CPU accelerator and a `world`-rank gloo group on
    localhost, as a learner rank has them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*)."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed

    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, rank=rank, world_size=world,
                               init_method=f"tcp://127.0.0.1:{port}", verbose=False)


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int):
    """In a spawned test worker: torch.distributed's default group, gloo on localhost, for the
    block; the ranks leave it together (a gloo peer torn down while another still closes aborts it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def sync_group_pair(timeout_s: float = 60) -> tuple:
    """Both ends (rank 0, rank 1) of a 2-member gloo weight-sync group (`new_group`, its header
    store included), built in this process by two threads: a learner thread sends to a receiver."""
    import threading

    from hpc_tba.comm.groups import free_ports
    from hpc_tba.comm.weight_sync import new_group

    port, out = free_ports(1)[0], {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, new_group(
        host="127.0.0.1", port=port, rank=r, size=2, backend="gloo", timeout_s=timeout_s))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out[0], out[1]


def spawn_ranks(fn, nprocs: int, args: tuple = (), *, timeout_s: float) -> list:
    """Run fn(rank, *args) in `nprocs` fresh (spawned) processes; returns each rank's return value
    (picklable, no tensors: their shared memory dies with the process). A rank that raises, dies or
    is still running after `timeout_s` fails the test, and no rank outlives the call."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(fn, rank, args, results)) for rank in range(nprocs)]
    for p in procs:
        p.start()
    deadline, out = time.monotonic() + timeout_s, {}
    try:
        while len(out) < nprocs:  # read before joining: a rank exits only once its result is read
            try:
                rank, value, error = results.get(timeout=1)
            except queue.Empty:
                died = {r: p.exitcode for r, p in enumerate(procs) if r not in out and p.exitcode}
                assert not died, f"{fn.__name__}: rank(s) died without a result, exit codes {died}"
                assert time.monotonic() < deadline, f"{fn.__name__} processes hung for {timeout_s:.0f}s"
                continue
            assert error is None, f"{fn.__name__} rank {rank} raised:\n{error}"
            out[rank] = value
        for rank, p in enumerate(procs):
            p.join(max(1.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"{fn.__name__} rank {rank} exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [out[rank] for rank in range(nprocs)]


def _rank_entry(fn, rank: int, args: tuple, results) -> None:
    try:
        value = fn(rank, *args)
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise
    results.put((rank, value, None))
    results.close()
    results.join_thread()  # the result is in the pipe: the process may end without its teardown
    from hpc_tba.cli.rank import exit_process

    exit_process(0)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_set_num_threads_restored():
    """vLLM's CPU worker replaces `torch.set_num_threads` with a no-op when an engine is built in
    this process (vllm/v1/worker/cpu_worker.py: its threads are bound); every later test of this
    process would then set threads in vain. Put the real one back after each test."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "_C") and torch.set_num_threads is not torch._C.set_num_threads:
        torch.set_num_threads = torch._C.set_num_threads


DEFAULT_RUN_STEPS, DEFAULT_RUN_SYNC_EVERY = 16, 2


def hpc_tba_status(run_dir) -> dict:
    """`hpc-tba status RUN_DIR --json`, as a user asks it."""
    import json
    import subprocess

    out = subprocess.run([HPC_TBA, "status", str(run_dir), "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """One short run of the default job (1 learner + 2 searchers) started as a user starts it,
    progress bar on, shared by the spine's and the first hour's tests (each checks its promises
    against what the run left): (run_dir, summary, terminal text, `hpc-tba status` seen while it
    ran at a step > 0, or None)."""
    import json
    import subprocess

    tmp = tmp_path_factory.mktemp("default_run")
    run_dir, terminal = tmp / "run", tmp / "terminal.txt"
    cmd = [HPC_TBA, "train", f"learner.total_steps={DEFAULT_RUN_STEPS}",
           f"learner.sync_every={DEFAULT_RUN_SYNC_EVERY}", "learner.eval_every=8",
           "learner.sync_check=true", "buffer.warm_start=100", f"run_dir={run_dir}"]
    env = {**os.environ, "HPC_TBA_NO_PROGRESS": "0"}  # the bar a user sees (tests turn it off)
    mid = None
    with open(terminal, "w") as term:
        proc = subprocess.Popen(cmd, stdout=term, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None and mid is None:
                if (run_dir / "status.json").exists():
                    s = hpc_tba_status(run_dir)
                    if s["state"] == "running" and s.get("step", 0) > 0:
                        mid = s
                time.sleep(0.5)
            assert proc.wait(timeout=900) == 0, terminal.read_text()[-5000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir, summary, open(terminal, newline="").read(), mid  # the bar's \r kept as written
