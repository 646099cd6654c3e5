"""Process groups from the topology: the learners' default group and the weight-sync group.

Rank 0 picks free ports and broadcasts the rendezvous over MPI (a handshake, no fixed ports, no
sleeps). Learner ranks form torch.distributed's default group (DeepSpeed ZeRO-3 runs on it);
learner rank 0 and every searcher form the standalone weight-sync group.
"""
from __future__ import annotations

import dataclasses
import os
import socket

from hpc_tba.comm.transport import MPITransport
from hpc_tba.comm.weight_sync import new_group
from hpc_tba.topology import Role, Topology


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


def _host() -> str:
    """An address the other ranks can reach (loopback when everything is on this machine)."""
    override = os.environ.get("HPC_TBA_MASTER_ADDR")
    if override:
        return override
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"


@dataclasses.dataclass
class Groups:
    backend: str
    sync_group: object | None
    """The weight-sync group on learner rank 0 and searchers; None on other learners."""


def setup_groups(transport: MPITransport, topo: Topology, *, backend: str) -> Groups:
    """Collective over every rank of the job."""
    backend = resolve_backend(backend)
    rdv = None
    if transport.rank == 0:
        learner_port, sync_port = free_ports(2)
        rdv = {"host": _host(), "learner_port": learner_port, "sync_port": sync_port}
    rdv = transport.bcast_json(rdv)
    rank = transport.rank
    if topo.role(rank) is Role.LEARNER:
        import deepspeed

        lrank = topo.learner_ranks.index(rank)
        os.environ.update(RANK=str(lrank), WORLD_SIZE=str(topo.num_learners),
                          LOCAL_RANK=str(lrank), MASTER_ADDR=rdv["host"],
                          MASTER_PORT=str(rdv["learner_port"]))
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   init_method=f"tcp://{rdv['host']}:{rdv['learner_port']}",
                                   rank=lrank, world_size=topo.num_learners, verbose=False)
    sync = None
    if rank in topo.sync_ranks and topo.num_searchers > 0:
        sync = new_group(host=rdv["host"], port=rdv["sync_port"], rank=topo.sync_ranks.index(rank),
                         size=len(topo.sync_ranks), backend=backend)
    return Groups(backend, sync)
