"""Process groups from the topology: the learners' default group and the weight-sync group.

Rank 0 picks free ports and broadcasts the rendezvous over MPI (a handshake, no fixed ports, no
sleeps). Learner ranks form torch.distributed's default group (DeepSpeed ZeRO-3 runs on it);
learner rank 0 and every searcher form the standalone weight-sync group.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket

from hpc_tba.comm.transport import Transport
from hpc_tba.comm.weight_sync import GROUP_TIMEOUT_S, new_group
from hpc_tba.config.topology import Role, Topology


def resolve_backend(name: str) -> str:
    """auto -> nccl where CUDA is present, else gloo."""
    if name != "auto":
        return name
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports free right now (all bound at once, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rendezvous_host(hostnames: list[str], environ=None) -> str:
    """The address every rank connects to for the rendezvous stores (hosted by rank 0).

    HPC_TBA_MASTER_ADDR when set; else the first node of the Slurm allocation (where rank 0
    runs), else this machine's name, resolved. `hostnames` are the machines of all ranks: when
    they differ, a loopback address (127.0.1.1 on many cluster images) would send every other
    node to itself, so it is refused with the fix in the message.
    """
    from hpc_tba.launcher.slurm import expand_nodelist

    env = os.environ if environ is None else environ
    override = env.get("HPC_TBA_MASTER_ADDR")
    if override:
        return override
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    spans = len(set(hostnames)) > 1
    name = nodes[0] if nodes else socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError:
        if spans:
            raise RuntimeError(f"the rendezvous host {name!r} (first node of the job) does not "
                               f"resolve and the job spans machines {sorted(set(hostnames))}; set "
                               "HPC_TBA_MASTER_ADDR to an address of rank 0's node") from None
        return "127.0.0.1"
    if spans and addr.startswith("127."):
        raise RuntimeError(f"the rendezvous host {name!r} resolves to the loopback address {addr} but "
                           f"the job spans machines {sorted(set(hostnames))}: the other nodes cannot "
                           "reach it. Set HPC_TBA_MASTER_ADDR to rank 0's address on the cluster network")
    return addr


def local_device_index(topo: Topology, rank: int, environ=None, *, gpus: bool = True) -> int:
    """LOCAL_RANK of a learner: the index of its GPU among the GPUs this process sees.

    Pinned by CUDA_VISIBLE_DEVICES (assembly.rank.setup_rank under Slurm: one GPU per
    learner) it is 0; on one machine without pinning, the node-local device index. Without GPUs
    (`gpus=False`: gloo on CPU) CUDA_VISIBLE_DEVICES means nothing and is not consulted.
    """
    env = os.environ if environ is None else environ
    physical = topo.devices_of(rank)[0]
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible or not gpus:
        return physical
    if str(physical) in visible:
        return visible.index(str(physical))
    if len(visible) == 1:  # Slurm's own binding gave this task one GPU under its own numbering
        return 0
    raise RuntimeError(f"learner rank {rank} should use GPU {physical} of its node, but "
                       f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')} lists several others")


def learner_env(topo: Topology, rank: int, rdv: dict, environ=None, *, gpus: bool = True) -> dict[str, str]:
    """torch.distributed's environment for a learner rank (the learners' default group)."""
    return {"RANK": str(topo.learner_ranks.index(rank)), "WORLD_SIZE": str(topo.num_learners),
            "LOCAL_RANK": str(local_device_index(topo, rank, environ, gpus=gpus)), "MASTER_ADDR": rdv["host"],
            "MASTER_PORT": str(rdv["learner_port"])}


@dataclasses.dataclass
class Groups:
    backend: str
    sync_group: object | None
    """The weight-sync group on learner rank 0 and searchers; None on other learners."""


def setup_groups(transport: Transport, topo: Topology, *, backend: str,
                 sync_backend: str | None = None) -> Groups:
    """Collective over every rank of the job. `sync_backend` (default: `backend`) lets a check
    on one GPU run the weight-sync group over gloo, since NCCL refuses two ranks on one GPU."""
    backend = resolve_backend(backend)
    sync_backend = backend if sync_backend is None else sync_backend
    hostnames = transport.allgather_json(socket.gethostname())
    rdv = None
    if transport.rank == 0:
        learner_port, sync_port = free_ports(2)
        rdv = {"host": rendezvous_host(hostnames), "learner_port": learner_port, "sync_port": sync_port}
    rdv = transport.bcast_json(rdv)
    rank = transport.rank
    if topo.role(rank) is Role.LEARNER:
        import deepspeed

        lrank = topo.learner_ranks.index(rank)
        os.environ.update(learner_env(topo, rank, rdv, gpus=backend == "nccl"))
        if backend == "nccl":  # DeepSpeed's accelerator then picks cuda:LOCAL_RANK
            import torch

            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   init_method=f"tcp://{rdv['host']}:{rdv['learner_port']}",
                                   rank=lrank, world_size=topo.num_learners, verbose=False,
                                   timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    sync = None
    if rank in topo.sync_ranks and topo.num_searchers > 0:
        sync = new_group(host=rdv["host"], port=rdv["sync_port"], rank=topo.sync_ranks.index(rank),
                         size=len(topo.sync_ranks), backend=sync_backend, timeout_s=GROUP_TIMEOUT_S)
    return Groups(backend, sync)
