"""`hpc-tba doctor`: a preflight of every node before any rank of a job starts.

The generated sbatch scripts run it first, one task per node (`srun --ntasks-per-node=1 ...
-m hpc_tba.cli.main doctor`); a user can run it by hand on a login or compute node. Each node checks
what it can see against the plan (`hpc_tba.plan.planner.make_plan` of the same config):

    GPUs visible against cluster.gpus_per_node; driver, CUDA and NCCL versions; the installed
    packages against hpc_tba/pins.py; the network devices NCCL will use (NCCL_SOCKET_IFNAME,
    NCCL_IB_HCA); the shared directory and the run directory writable; free space in the
    checkpoint staging directory against this node's share of a checkpoint, and on the shared
    filesystem against the checkpoints kept; /dev/shm; real host memory (/proc/meminfo, and the
    cgroup's limit where Slurm set one) against the planner's figure for this node's kind; and,
    when the job spans nodes, a short all-reduce across them whose bus bandwidth is compared with
    cluster.network_gbit_per_s x cluster.nics_per_node.

Node 0 prints one table (a column per node) and, inside a Slurm job, writes it to
`<run_dir>/doctor.txt`; that report is all the doctor writes. Any failure: one line per problem
(`hpc-tba doctor: <node>: <problem>`) and every task exits 1, so the script stops before the ranks.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hpc_tba.plan.memory import GiB

if TYPE_CHECKING:
    from hpc_tba.config import RunConfig
    from hpc_tba.plan.memory import Plan

SHM_NEED_BYTES = {"gpu": 1 * GiB, "cpu": 64 * 2**20}
"""/dev/shm a node needs: NCCL's shared-memory transport between GPUs of a node and vLLM's message
queues live there (a container's 64 MiB default makes NCCL fail at its first collective); CPU
nodes only need what torch's and gloo's shared tensors take."""
MIN_BANDWIDTH_FRACTION = 0.5
"""The cross-node all-reduce's bus bandwidth must reach this fraction of the configured network
(NCCL's large-message all-reduce reaches ~80-90% of line rate; half says a link or an interface
choice is wrong, e.g. TCP on the management network instead of InfiniBand)."""
ALLREDUCE_BYTES = {"gpu": 256 * 2**20, "cpu": 4 * 2**20}
"""Size of the all-reduce buffer (large enough for NCCL's bandwidth regime, small enough for
seconds on CPU stand-ins)."""
ALLREDUCE_ITERS = 5
RENDEZVOUS_TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class Check:
    """One row of the table on one node."""

    name: str
    value: str
    problem: str = ""
    """Empty when the check passed; else one line saying what is wrong and what to do."""


def node_kind(cfg: RunConfig, node_id: int) -> str:
    """Which of memory.NODE_KINDS node `node_id` of the layout is."""
    from hpc_tba.config.topology import Topology

    topo = Topology.for_run(cfg)
    if node_id == 0:
        return "learner0"
    return "learner" if node_id < topo.learner_nodes else "searcher"


def host_need(plan: Plan, cfg: RunConfig, kind: str) -> float:
    """Host bytes the plan says a node of `kind` needs; on a one-node layout every kind is there."""
    from hpc_tba.config.topology import Topology

    if Topology.for_run(cfg).num_nodes == 1:
        return plan.host_bytes.get("learner0", 0.0) + plan.host_bytes.get("searcher", 0.0)
    return plan.host_bytes.get(kind, 0.0)


# ---- the checks of one node -------------------------------------------------------------------
def check_gpus(cfg: RunConfig) -> list[Check]:
    want = cfg.cluster.gpus_per_node
    count, cuda, nccl = 0, "none", "none"
    try:
        import torch

        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            cuda = str(torch.version.cuda)
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # a broken CUDA install is a finding, not a crash of the doctor
        cuda = f"torch.cuda failed: {type(e).__name__}: {e}"
    driver = "none"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        driver = out.stdout.split("\n")[0].strip() or f"nvidia-smi failed: {out.stderr.strip()[:80]}"
    problem = ""
    if count < want:
        problem = (f"{count} GPUs visible, the plan needs {want} (cluster.gpus_per_node): "
                   "check --gpus-per-node, CUDA_VISIBLE_DEVICES and the driver")
    return [Check("GPUs", f"{count} (plan {want})", problem),
            Check("driver / CUDA / NCCL", f"{driver} / {cuda} / {nccl}")]


def check_pins() -> Check:
    from hpc_tba import pins

    found = pins.mismatches()
    if not found:
        return Check("packages (hpc_tba/pins.py)", f"as pinned ({pins.installed_build()} build)")
    listed = "; ".join(f"{n} {have} installed, pinned {want}" for n, have, want in found)
    return Check("packages (hpc_tba/pins.py)", f"{len(found)} differ",
                 f"{listed}: install the pinned versions (tools/install.sh)")


def _matches_ifname(name: str, spec: str) -> bool:
    """NCCL_SOCKET_IFNAME's syntax: comma-separated prefixes, `=` for exact names, `^` to exclude."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    items = [s for s in spec.lstrip("=").split(",") if s]
    hit = any(name == s if exact else name.startswith(s) for s in items)
    return hit != exclude


def check_network(cfg: RunConfig, *, multi_node: bool, sys_root: str = "/sys") -> Check:
    """The interfaces NCCL may use for sockets and the InfiniBand devices it sees."""
    env = {**os.environ, **cfg.cluster.env}
    try:
        ifaces = sorted(os.listdir(os.path.join(sys_root, "class", "net")))
    except OSError:
        ifaces = []
    try:
        hcas = sorted(os.listdir(os.path.join(sys_root, "class", "infiniband")))
    except OSError:
        hcas = []
    spec = env.get("NCCL_SOCKET_IFNAME", "")
    usable = [i for i in ifaces if (_matches_ifname(i, spec) if spec else i != "lo" and not i.startswith("docker"))]
    value = f"sockets {','.join(usable) or 'none'}; IB {','.join(hcas) or 'none'}"
    problem = ""
    if spec and not usable:
        problem = f"NCCL_SOCKET_IFNAME={spec} matches none of this node's interfaces ({', '.join(ifaces)})"
    elif multi_node and not usable and not hcas:
        problem = "no network interface but loopback: the nodes cannot reach each other"
    hca_spec = env.get("NCCL_IB_HCA", "")
    if hca_spec and not problem:
        wanted = [h.split(":")[0] for h in hca_spec.lstrip("^=").split(",") if h]
        if not hca_spec.startswith("^") and not any(h.startswith(w) for h in hcas for w in wanted):
            problem = f"NCCL_IB_HCA={hca_spec} names no InfiniBand device of this node ({', '.join(hcas) or 'none'})"
    return Check("network (NCCL)", value, problem)


def check_dirs(cfg: RunConfig, plan: Plan, *, shared: str, node_id: int) -> list[Check]:
    """The shared directory exists and takes a write; free space for checkpoints."""
    checks = []
    root = shared or cfg.cluster.shared_dir or _existing_ancestor(cfg.run_dir)
    if not os.path.isdir(root):
        checks.append(Check("shared directory", root, f"shared directory {root} does not exist on this "
                            "node (cluster.shared_dir / HPC_TBA_SHARED): is the filesystem mounted?"))
    else:
        probe = os.path.join(root, f".hpc_tba_doctor_{socket.gethostname()}_{os.getpid()}")
        try:
            with open(probe, "w") as f:
                f.write("probe")
                f.flush()
                os.fsync(f.fileno())
            os.remove(probe)
            checks.append(Check("shared directory", f"{root} writable"))
        except OSError as e:
            checks.append(Check("shared directory", root, f"shared directory {root} is not writable: {e}"))
        if node_id == 0:
            need = plan.terms.get("checkpoint_footprint", 0.0)
            free = shutil.disk_usage(root).free
            problem = "" if free >= need else (
                f"the shared filesystem has {free / 1e9:.1f} GB free at {root}, the checkpoints kept "
                f"need {need / 1e9:.1f} GB (learner.keep_last + 1 saves): free space or lower keep_last")
            checks.append(Check("shared free space", f"{free / 1e9:.1f} GB (checkpoints {need / 1e9:.1f} GB)",
                                problem))
    checks.append(_check_staging(cfg, plan, node_id=node_id))
    return checks


def _existing_ancestor(path: str) -> str:
    """`path`, or the nearest directory above it that exists (what a makedirs would write into)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _check_staging(cfg: RunConfig, plan: Plan, *, node_id: int) -> Check:
    from hpc_tba.config.topology import Topology

    c = cfg.cluster
    if not c.checkpoint_staging_dir:
        return Check("checkpoint staging", "none (cluster.checkpoint_staging_dir)")
    topo = Topology.for_run(cfg)
    learners_here = sum(1 for r in topo.learner_ranks if topo.node_of(r) == node_id)
    if not learners_here:
        return Check("checkpoint staging", "no learner on this node")
    root = os.path.expandvars(os.path.expanduser(c.checkpoint_staging_dir))
    if "$" in root:
        return Check("checkpoint staging", root, f"cluster.checkpoint_staging_dir={c.checkpoint_staging_dir}: "
                     "an environment variable in it is not set on this node")
    existing = _existing_ancestor(root)
    need = plan.terms.get("checkpoint", 0.0) / max(c.num_learners, 1) * learners_here
    free = shutil.disk_usage(existing or "/").free
    problem = "" if free >= need else (
        f"checkpoint staging {root} has {free / 1e9:.1f} GB free, this node's {learners_here} learner ranks "
        f"write {need / 1e9:.1f} GB per checkpoint: point cluster.checkpoint_staging_dir at a larger local disk")
    return Check("checkpoint staging", f"{root}: {free / 1e9:.1f} GB free (needs {need / 1e9:.1f} GB)", problem)


def check_shm(cfg: RunConfig, path: str = "/dev/shm") -> Check:
    kind = "gpu" if cfg.cluster.gpus_per_node else "cpu"
    need = SHM_NEED_BYTES[kind]
    try:
        size = os.statvfs(path).f_blocks * os.statvfs(path).f_frsize
    except OSError:
        size = 0
    problem = "" if size >= need else (
        f"{path} holds {size / 2**20:.0f} MiB, {kind} nodes need >= {need / 2**20:.0f} MiB (NCCL's "
        "shared-memory transport, vLLM's queues): a container needs --shm-size")
    return Check("/dev/shm", f"{size / GiB:.1f} GiB", problem)


def host_memory_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup/memory.max") -> int:
    """This node's memory for the job: MemTotal, or the cgroup's limit where it is lower."""
    with open(meminfo) as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    try:
        with open(cgroup) as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def check_memory(cfg: RunConfig, plan: Plan, kind: str) -> Check:
    have = host_memory_bytes()
    need = host_need(plan, cfg, kind)
    value = f"{have / GiB:.1f} GiB (plan {need / GiB:.1f} GiB for a {kind} node)"
    problem = "" if need <= have else (
        f"host memory {have / GiB:.1f} GiB, the plan needs {need / GiB:.1f} GiB on a {kind} node "
        "(`hpc-tba plan` lists the terms): more memory per node, or fewer ranks or held versions on it")
    return Check("host memory", value, problem)


def local_checks(cfg: RunConfig, plan: Plan, *, node_id: int, multi_node: bool, shared: str) -> list[Check]:
    """Every check of this node but the cross-node all-reduce."""
    kind = node_kind(cfg, node_id)
    return [Check("node", f"{socket.gethostname()} ({kind})"), *check_gpus(cfg), check_pins(),
            check_network(cfg, multi_node=multi_node), *check_dirs(cfg, plan, shared=shared, node_id=node_id),
            check_shm(cfg), check_memory(cfg, plan, kind)]


# ---- across nodes ------------------------------------------------------------------------------
def allreduce_check(cfg: RunConfig, comm) -> Check:
    """A short all-reduce over every node (one task each): NCCL on GPU nodes, gloo on CPU nodes,
    rendezvous as the run's own (rank 0's address and a free port broadcast over MPI)."""
    import torch
    import torch.distributed as dist

    from hpc_tba.comm.groups import free_ports, rendezvous_host

    gpu = cfg.cluster.gpus_per_node > 0
    hostnames = comm.allgather(socket.gethostname())
    rdv = comm.bcast((rendezvous_host(hostnames), free_ports(1)[0]) if comm.Get_rank() == 0 else None, root=0)
    n, rank = comm.Get_size(), comm.Get_rank()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{rdv[0]}:{rdv[1]}", rank=rank,
                            world_size=n, timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    try:
        nbytes = ALLREDUCE_BYTES["gpu" if gpu else "cpu"]
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(buf)  # warm-up: connections are set up here
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(ALLREDUCE_ITERS):
            dist.all_reduce(buf)
        if gpu:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / ALLREDUCE_ITERS
        exact = float(buf[0]) == float(n ** (ALLREDUCE_ITERS + 1))
    finally:
        dist.destroy_process_group()
    busbw = 2 * (n - 1) / n * nbytes / dt  # bytes/s, NCCL's bus bandwidth convention
    c = cfg.cluster
    want = c.network_gbit_per_s * c.nics_per_node / 8 * 1e9
    value = (f"{busbw * 8 / 1e9:.1f} Gbit/s bus bandwidth over {n} nodes ({nbytes >> 20} MiB; configured "
             f"{c.network_gbit_per_s:g} x {c.nics_per_node} Gbit/s)")
    problem = ""
    if not exact:
        problem = "the cross-node all-reduce returned a wrong sum"
    elif busbw < MIN_BANDWIDTH_FRACTION * want:
        problem = (f"cross-node all-reduce reached {busbw * 8 / 1e9:.1f} Gbit/s, under "
                   f"{MIN_BANDWIDTH_FRACTION:.0%} of cluster.network_gbit_per_s x nics_per_node = "
                   f"{want * 8 / 1e9:.0f} Gbit/s: check NCCL_SOCKET_IFNAME / NCCL_IB_HCA, or set the "
                   "network speed the nodes really have")
    return Check("cross-node all-reduce", value, problem)


# ---- the report --------------------------------------------------------------------------------
def format_table(per_node: Sequence[Sequence[Check]]) -> str:
    """One row per check: its value where every node agrees, else each node's (`node i: ...`)."""
    names = list(dict.fromkeys(ch.name for checks in per_node for ch in checks))
    cells = [{ch.name: ("FAIL " if ch.problem else "") + ch.value for ch in checks} for checks in per_node]
    width = max(len(n) for n in names)
    rows = []
    for name in names:
        values = [c.get(name, "-") for c in cells]
        if len(set(values)) == 1:
            rows.append(f"{name:<{width}}  {values[0]}" + (f"  (all {len(values)} nodes)" if len(values) > 1 else ""))
        else:
            rows += [f"{name if i == 0 else '':<{width}}  node {i}: {v}" for i, v in enumerate(values)]
    return "\n".join(rows) + "\n"


def problems(per_node: Sequence[Sequence[Check]]) -> list[str]:
    return [f"node {i}: {ch.problem}" for i, checks in enumerate(per_node) for ch in checks if ch.problem]


def run_doctor(cfg: RunConfig, *, shared: str = "") -> int:
    """The preflight on this task's node; under srun with one task per node, across the job.
    Returns 0 when every node passed, 1 otherwise (the same on every task)."""
    from hpc_tba.launcher.slurm import SlurmEnv
    from hpc_tba.plan.planner import PlanOptions, make_plan

    env = SlurmEnv.from_environ()
    ntasks = env.ntasks if env else 1
    plan = make_plan(cfg, PlanOptions(deepspeed=False))
    comm = None
    if ntasks > 1:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    node_id = env.node_id if env else 0
    checks = local_checks(cfg, plan, node_id=node_id, multi_node=ntasks > 1, shared=shared)
    if plan.problems:
        checks.append(Check("plan", "REFUSED", "; ".join(plan.problems)))
    if comm is not None:
        try:
            checks.append(allreduce_check(cfg, comm))
        except Exception as e:  # a node that cannot join is the finding
            checks.append(Check("cross-node all-reduce", "failed", f"{type(e).__name__}: {e}"))
        per_node = comm.gather(checks, root=0)
    else:
        per_node = [checks]
    failed = 0
    if comm is None or comm.Get_rank() == 0:
        restart = env.restart_count if env else 0
        text = (f"hpc-tba doctor: {cfg.name}, {len(per_node)} node(s)"
                f"{f', job {env.job_id} restart {restart}' if env else ''}\n" + format_table(per_node))
        found = problems(per_node)
        sys.stdout.write(text)
        for line in found:
            print(f"hpc-tba doctor: {line}", file=sys.stderr)
        if env is not None and not any(ch.name == "shared directory" and ch.problem for ch in per_node[0]):
            os.makedirs(cfg.run_dir, exist_ok=True)
            with open(os.path.join(cfg.run_dir, "doctor.txt"), "w") as f:
                f.write(text + "".join(f"PROBLEM {line}\n" for line in found))
        failed = int(bool(found))
        sys.stdout.flush()
    if comm is not None:
        failed = comm.bcast(failed, root=0)
    return failed


def doctor_main(argv: list[str]) -> int:
    """`hpc-tba doctor [--shared DIR] <overrides>`: 0 every check passed, 1 a problem, 2 a bad config."""
    from hpc_tba.assembly.compose import compose
    from hpc_tba.config import ConfigError

    args, shared = list(argv), ""
    if "--shared" in args:
        i = args.index("--shared")
        if i + 1 >= len(args):
            raise ConfigError("hpc-tba doctor: --shared needs a directory")
        shared = args[i + 1]
        del args[i:i + 2]
    return run_doctor(compose(args), shared=shared)


def main() -> int:
    """What the sbatch scripts run on every node: `python -m hpc_tba.cli.doctor <overrides>`
    (= `hpc-tba doctor`); a bad configuration is one line and exit 2, as there."""
    from hpc_tba.config import ConfigError
    from hpc_tba.config.topology import LayoutError

    try:
        return doctor_main(sys.argv[1:])
    except (ConfigError, LayoutError) as e:
        print(f"hpc-tba: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
